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
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "warning",
) -> None:
    """Run one simulated vLLM 0.33 engine (OpenAI server + NixlConnector P/D protocol)."""
    import uvicorn

    from agentkv.sim import Faults, SimConfig, create_app

    extra = {"engine_id": engine_id} if engine_id else {}
    try:
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
        typer.echo(f"agentkv sim: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(
        f"agentkv sim: {config.role} engine {config.engine_id} on http://{host}:{port} "
        f"(model {served_model_name}, block size {block_size}, preset {preset}, compat {compat})",
        err=True,
    )
    uvicorn.run(application, host=host, port=port, log_level=log_level, access_log=False)


@app.command()
def demo(
    profile: Annotated[
        str, typer.Option(help="Simulator profile to start (or use, when already running).")
    ] = "local",
) -> None:
    """Run a tool-using agent on the default backend (started if none is running) and compare
    verified reuse with a naive client and with unverified reuse."""
    from agentkv.serve.demo import run_demo

    _profile(profile)
    raise typer.Exit(run_demo(profile=profile))


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
) -> None:
    """Start a P/D deployment (engines + router) from a profile and supervise it."""
    from rich.console import Console

    from agentkv.serve import check_runtime, expand
    from agentkv.serve.supervisor import ServeError, Supervisor

    prof = _profile(profile or _default_profile())
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
    supervisor = Supervisor(deployment, console=console)
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


profiles_app = typer.Typer(
    help="Launch profiles: list, show, validate, render.", no_args_is_help=True
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
    log_level: Annotated[str, typer.Option(help="Log level.")] = "info",
) -> None:
    """Run agentkv's KV-aware P/D router: verified bidirectional KV reuse per conversation."""
    import logging

    import uvicorn
    from pydantic import ValidationError

    from agentkv.router import RouterConfig, create_app

    overrides = {
        "prefill": [{"url": u} for u in prefill] if prefill else None,
        "decode": [{"url": u} for u in decode] if decode else None,
        "host": host,
        "port": port,
        "block_size": block_size,
        "decoder_kv_blocks_ttl_s": decoder_kv_blocks_ttl,
        "store": store,
    }
    try:
        if config:
            cfg = RouterConfig.load(config, **overrides)
        else:
            cfg = RouterConfig.model_validate({k: v for k, v in overrides.items() if v is not None})
    except (ValidationError, ValueError, OSError) as exc:
        typer.echo(f"agentkv router: invalid configuration: {exc}", err=True)
        raise typer.Exit(2) from exc
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    typer.echo(
        f"agentkv router on http://{cfg.host}:{cfg.port}: "
        f"{len(cfg.prefill)} prefill, {len(cfg.decode)} decode, store {cfg.store}, "
        f"router TTL {cfg.router_ttl_s:.0f}s",
        err=True,
    )
    uvicorn.run(
        create_app(cfg), host=cfg.host, port=cfg.port, log_level="warning", access_log=False
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


def main() -> None:
    app()
