"""Stale /dev/shm swept before every start (#30): a vLLM mode with a CPU tier in /dev/shm
runs `python3 -m kvtier_offload sweep-shm -- <its command>` in the engine container (so
a container restart sweeps too; an init container would not), gets the offload package
for it, and a command kvtier cannot read with certainty is a named conflict. The last
test runs the rendered command line for real."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import textwrap

import pytest

from kvtier_operator import names
from kvtier_operator.context import RenderContext
from kvtier_operator.render.pod import inject
from kvtier_operator.validation import parse_tpc
from tests.helpers import ROOT, tpc_doc, vllm_pod

PREFIX = list(names.SHM_SWEEP_PREFIX)
CPU_ONLY = {"storage": None}


def _spec(**spec):
    doc = tpc_doc({k: v for k, v in spec.items() if v is not None})
    for k, v in spec.items():
        if v is None:
            doc["spec"].pop(k, None)
    return doc


def _inject(doc, **container):
    return inject(parse_tpc(doc), vllm_pod(**container), RenderContext())


def _engine(result) -> dict:
    return result.pod["spec"]["containers"][0]


@pytest.mark.parametrize("doc", [
    _spec(storage=None),  # CPU tier only
    _spec(storage={"pvc": {"size": "1Ti"}}),  # kvtier's backend
    _spec(storage={"pvc": {"size": "1Ti"}, "backend": "vllm-fs"}),
], ids=["cpu-only", "kvtier", "vllm-fs"])
def test_every_mode_with_a_cpu_tier_sweeps_before_the_engine(doc):
    result = _inject(doc)
    assert result.changed, result.conflicts
    engine = _engine(result)
    assert engine["command"] == [*PREFIX, "vllm", "serve"]
    inits = result.pod["spec"]["initContainers"]
    assert [c["name"] for c in inits] == [names.INIT_CONTAINER]
    env = {e["name"]: e.get("value") for e in engine["env"]}
    assert env["PYTHONPATH"].split(":")[0] == names.SITE_MOUNT
    assert {"name": names.VOLUME_SITE, "mountPath": names.SITE_MOUNT,
            "readOnly": True} in engine["volumeMounts"]


def test_modes_without_a_region_in_dev_shm_are_left_as_they_start():
    no_cpu = _spec(cpu=None)
    assert _engine(_inject(no_cpu))["command"] == ["vllm", "serve"]
    lmcache = _spec(connector="lmcache", storage=None)
    result = _inject(lmcache)
    assert result.changed and _engine(result)["command"] == ["vllm", "serve"]
    assert "initContainers" not in result.pod["spec"]


def test_the_sweep_goes_after_a_launcher_and_before_a_script():
    tini = _engine(_inject(CPU := _spec(storage=None),
                           command=["tini", "--", "vllm", "serve"]))
    assert tini["command"] == ["tini", "--", *PREFIX, "vllm", "serve"]
    script = _engine(_inject(CPU, command=["/bin/sh", "-c"],
                             args=["echo hi; exec vllm serve m"]))
    assert script["command"] == [*PREFIX, "/bin/sh", "-c"]
    assert script["args"][0].startswith("echo hi; exec vllm serve m --kv-transfer-config")


def test_injecting_twice_does_not_wrap_twice():
    doc = _spec(storage=None)
    once = _engine(_inject(doc))
    pod = vllm_pod(command=once["command"], args=["m"])
    again = inject(parse_tpc(doc), pod, RenderContext())
    assert again.pod["spec"]["containers"][0]["command"] == [*PREFIX, "vllm", "serve"]


def test_a_command_kvtier_cannot_read_is_a_named_conflict():
    # no command: the image's entrypoint starts vLLM; kvtier cannot tell what runs
    result = _inject(_spec(storage=None), command=None, args=["vllm", "serve", "m"])
    assert not result.changed
    assert any(c.startswith("ShmSweepUncertain:") for c in result.conflicts), result.conflicts


def test_the_sweep_changes_the_config_hash():
    with_cpu = parse_tpc(_spec(storage=None))
    from kvtier_operator.plan import pod_plan
    plan = pod_plan(with_cpu, RenderContext())
    assert plan.command_prefix == names.SHM_SWEEP_PREFIX
    import dataclasses
    assert dataclasses.replace(plan, command_prefix=None).hash() == plan.hash()  # stored
    # the digest itself takes the prefix: two plans that differ only there differ
    from kvtier_operator import plan as plan_module
    args = (with_cpu, plan.adapter, plan.launch_options, plan.server_env, plan.claim,
            plan.mount_path, plan.extra_volumes, plan.offload_image)
    assert plan_module._digest(*args, None) != plan_module._digest(*args, plan.command_prefix)


# The rendered command line for real, in a private /dev/shm: a stale region (a killed
# engine's) is there before the start; the wrapped command removes it, then execs the
# engine (a stand-in `vllm` that shows its argv and what /dev/shm holds).
FAKE_VLLM = textwrap.dedent("""\
    #!/bin/sh
    echo "engine pid $$ args: $*"
    echo "shm: $(ls /dev/shm)"
""")
SCENARIO = textwrap.dedent("""
    set -u
    mount -t tmpfs -o size=16m tmpfs /dev/shm || exit 77
    head -c 1048576 /dev/zero > /dev/shm/vllm_offload_dead.mmap
    head -c 4096 /dev/zero > /dev/shm/vllm_offload_dead.mmap.1
    echo "before: $(ls /dev/shm | tr '\\n' ' ')"
    echo "shell pid $$"
    exec "$@"
""")


@pytest.mark.privileged
@pytest.mark.timeout(120)
def test_the_rendered_command_sweeps_then_execs_the_engine(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("a private mount namespace with its own /dev/shm needs root")
    engine = _engine(_inject(_spec(storage=None)))
    argv = [*engine["command"], *engine["args"]]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "vllm").write_text(FAKE_VLLM)
    (bin_dir / "vllm").chmod(0o755)
    (bin_dir / "python3").symlink_to(sys.executable)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT / "offload")}
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                          SCENARIO, "sh", *argv], capture_output=True, text=True,
                         timeout=100, check=False, env=env)
    if out.returncode == 77 or "unshare failed" in out.stderr:
        pytest.skip(f"cannot mount a private /dev/shm here: {out.stderr.strip()}")
    lines = out.stdout.splitlines()
    assert "before: vllm_offload_dead.mmap vllm_offload_dead.mmap.1 " in lines, out
    assert "removed 2 stale region file(s)" in out.stderr, out.stderr
    shell_pid = next(line.split()[-1] for line in lines if line.startswith("shell pid"))
    engine_line = next(line for line in lines if line.startswith("engine pid"))
    # exec all the way: the engine is the process the container started, same pid
    assert engine_line.startswith(f"engine pid {shell_pid} args: serve ")
    assert shlex.split(engine_line)[5:7] == ["Qwen/Qwen3-32B", "--tensor-parallel-size=2"]
    assert "shm: " in lines, out.stdout  # nothing left in /dev/shm when the engine starts
