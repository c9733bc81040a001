"""docs/launchers.md's snippets, run under the launchers they are written for:
``torch_xla.launch`` with 4 XLA:CPU replicas, and ``torchrun`` with 2 gloo
processes; and what a user sees when a launch is set up wrong."""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import XLA_CPU, clean_env, needs_xla, run

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "launchers.md"


TORCHRUN_2 = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")



def torchrun(tmp_path: pathlib.Path, code: str, env: dict[str, str] | None = None):
    """``code`` run as a script by torchrun in 2 gloo processes, which both exit 0."""
    script = tmp_path / "script.py"
    script.write_text(code)
    result = run(script, env or {}, *TORCHRUN_2)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def snippet(name: str) -> str:
    text = DOC.read_text().split(f"<!-- launcher: {name} -->", 1)[1]
    return textwrap.dedent(text.split("```python\n", 1)[1].split("```", 1)[0])


def command(name: str, replace: dict[str, str]) -> list[str]:
    """The docs' bash command after ``<!-- launcher: name -->`` as an argument
    list (comments dropped, continuation lines joined, each key of ``replace``
    replaced by its value), ``torchrun`` run by this interpreter."""
    text = DOC.read_text().split(f"<!-- launcher: {name} -->", 1)[1]
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [line for line in block.splitlines() if not line.lstrip().startswith("#")]
    words = shlex.split(" ".join(lines).replace("\\ ", " "))
    for key, value in replace.items():
        words = [w.replace(key, value) for w in words]
    assert words[0] == "torchrun", words
    return [sys.executable, "-m", "torch.distributed.run", *words[1:]]




@needs_xla
@pytest.mark.parametrize("pool", ["16", "4", "unset"])
def test_torch_xla_launch_on_cpu_runs_the_docs_snippet(tmp_path, pool):
    # (a pool of exactly the 4 replicas: the docs say at least W threads;
    # unset, the docs' command: the script's import of xcoll makes it 16)
    script = tmp_path / "script.py"
    script.write_text(snippet("xla"))
    result = run(script, {**XLA_CPU, **({} if pool == "unset" else {"XLA_THREAD_POOL_SIZE": pool})})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "preds [0.0, 1.0, 2.0, 10.0, 11.0, 12.0, 20.0, 21.0, 22.0, 30.0, 31.0, 32.0]" in (
        result.stdout
    ), result.stdout
    assert "count [12] of 4 replicas" in result.stdout, result.stdout


def _imported(env: dict[str, str]) -> dict[str, str | None]:
    """What ``import xcoll`` leaves of XLA:CPU's settings, in a fresh process."""
    code = (
        "import os, xcoll; print(os.environ.get('XLA_THREAD_POOL_SIZE'), "
        "os.environ.get('PJRT_CPU_ASYNC_CLIENT'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env={**clean_env(), **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    pool, client = out.stdout.split()
    return {"pool": None if pool == "None" else pool, "client": client}


def test_importing_xcoll_gives_xla_cpu_replicas_their_pool_and_client_where_unset():
    # (before: a pool of the cores' number, 2 on CI, and the docs' command,
    # with no XLA_THREAD_POOL_SIZE, aborted the snippet at W=4: 5 runs of 5)
    assert _imported(XLA_CPU) == {"pool": "16", "client": "false"}
    assert _imported({**XLA_CPU, "CPU_NUM_DEVICES": "12"}) == {"pool": "24", "client": "false"}
    # the user's own settings are kept, and one device needs no pool
    mine = {**XLA_CPU, "XLA_THREAD_POOL_SIZE": "5", "PJRT_CPU_ASYNC_CLIENT": "true"}
    assert _imported(mine) == {"pool": "5", "client": "true"}
    assert _imported({"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1"})["pool"] is None
    assert _imported({})["pool"] is None


@pytest.mark.parametrize(
    "setting, want",
    [(None, os.cpu_count()), ("", os.cpu_count()), ("many", os.cpu_count()), ("5", 5), (" 7 ", 7)],
)
def test_the_thread_pool_xcoll_checks_is_the_setting_or_else_the_cores(monkeypatch, setting, want):
    # (what the check of a pool smaller than the replicas reads: the cores
    # where a runtime started before xcoll's import, unset)
    from xcoll._backends._launch import thread_pool

    if setting is None:
        monkeypatch.delenv("XLA_THREAD_POOL_SIZE", raising=False)
    else:
        monkeypatch.setenv("XLA_THREAD_POOL_SIZE", setting)
    assert thread_pool() == want


@needs_xla
def test_a_thread_pool_smaller_than_the_replicas_is_named_not_aborted(tmp_path):
    # a pool set smaller than W (the default, one per core, where xcoll is
    # imported after the runtime starts); XLA alone would abort after 10 s
    script = tmp_path / "script.py"
    script.write_text(snippet("xla"))
    result = run(script, {**XLA_CPU, "XLA_THREAD_POOL_SIZE": "2"})
    assert result.returncode != 0
    assert "thread pool has 2" in result.stderr and "XLA_THREAD_POOL_SIZE=16" in result.stderr, (
        result.stderr[-3000:]
    )
    assert "Termination timeout" not in result.stderr


@needs_xla
def test_several_devices_without_a_launcher_are_named(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(snippet("xla").replace("torch_xla.launch(main)", "main(0)"))
    result = run(script, {**XLA_CPU, "XLA_THREAD_POOL_SIZE": "16"})
    assert result.returncode != 0
    assert "runs as a world of one: start the function with torch_xla.launch" in result.stderr, (
        result.stderr[-3000:]
    )


def test_torchrun_with_gloo_runs_the_docs_snippet(tmp_path):
    result = torchrun(tmp_path, snippet("torchrun"))
    assert "preds [0.0, 1.0, 2.0, 10.0, 11.0, 12.0]" in result.stdout, result.stdout
    assert "count [6] of 2 replicas" in result.stdout, result.stdout


# One write per line: print's separate writes of the text and its newline
# interleave between the two processes' shared stdout.
_SAY = """
import sys
def say(*words):
    sys.stdout.write(" ".join(map(str, words)) + "\\n")
    sys.stdout.flush()
"""

# What a user of accelerate does: an Accelerator, then xcoll calls on CPU
# tensors and on the accelerator's device. With torch_xla installed and
# USE_TORCH_XLA unset, Accelerator(cpu=True) takes accelerate's XLA path (even
# with cpu=True and no PJRT_DEVICE): XLA's runtime starts, torch.distributed is
# not initialised, and each process is a world of one.
_ACCELERATE_XLA_PATH = _SAY + """
import os, torch, torch.distributed as dist, xcoll
from accelerate import Accelerator
from accelerate.utils import broadcast, gather, gather_object, reduce
accelerator = Accelerator(cpu=True)
rank = int(os.environ["RANK"])
say("state", accelerator.distributed_type, accelerator.device.type, accelerator.num_processes,
      "dist", dist.is_initialized())
# accelerate's own collectives return this process's values alone, without an error
mine = lambda: (torch.arange(2.0) + 10 * rank).to(accelerator.device)
say("accelerate", rank, gather(mine()).cpu().tolist(), reduce(mine(), "sum").cpu().tolist(),
      broadcast(mine(), from_process=0).cpu().tolist())
try:
    gather_object([rank])
except NotImplementedError as e:
    say("gather_object raised", e)


def calls(when):
    for where, dev in (("cpu", torch.device("cpu")), ("accelerator.device", accelerator.device)):
        try:
            out = xcoll.gather({"x": (torch.arange(2.0) + 10 * rank).to(dev)})
            say("returned", when, where, out["x"].cpu().tolist())
        except (TypeError, RuntimeError) as e:
            say("raised", when, where, type(e).__name__, e)


calls("alone")
# the errors' other way out: a process group of one's own, which serves CPU leaves
dist.init_process_group("gloo")
calls("with-dist")
dist.destroy_process_group()
"""


def test_accelerate_on_its_xla_path_in_a_torchrun_job_names_use_torch_xla(tmp_path):
    result = torchrun(tmp_path, _ACCELERATE_XLA_PATH)  # both processes ended: no hang
    out = result.stdout.splitlines()
    assert out.count("state DistributedType.XLA xla 1 dist False") == 2, result.stdout
    assert sorted(x for x in out if x.startswith("accelerate")) == [
        "accelerate 0 [0.0, 1.0] [0.0, 1.0] [0.0, 1.0]",
        "accelerate 1 [10.0, 11.0] [10.0, 11.0] [10.0, 11.0]",
    ], result.stdout
    assert sum(x.startswith("gather_object raised") for x in out) == 2, result.stdout
    ends = [x for x in out if x.startswith(("raised", "returned"))]
    assert len(ends) == 8, result.stdout  # four calls on each of the two processes
    own_group = ", or call torch.distributed.init_process_group first"
    cases = [
        ("alone cpu TypeError", own_group),
        ("alone accelerator.device RuntimeError", ""),
        ("with-dist accelerator.device RuntimeError", ""),
    ]
    for start, then in cases:
        lines = [x for x in ends if x.startswith(f"raised {start}")]
        assert len(lines) == 2, result.stdout
        assert {("rank 0 of 2" in x, "rank 1 of 2" in x) for x in lines} == {
            (True, False),
            (False, True),
        }, lines
        for x in lines:
            # only what helps: XLA leaves are not served by a process group
            assert x.endswith(f"set USE_TORCH_XLA=0){then} (docs/launchers.md)"), x
            assert "move the leaves to the replica's XLA device" not in x, x
    assert ends.count("returned with-dist cpu [0.0, 1.0, 10.0, 11.0]") == 2, result.stdout


# With USE_TORCH_XLA=0 the same Accelerator(cpu=True) initialises gloo itself
# (accelerate's MULTI_CPU path, from torchrun's environment): xcoll uses that
# process group, and docs/migration.md's accelerate "before" snippets give what
# their xcoll "after" gives.
_ACCELERATE_GLOO = _SAY + """
import optree, torch, torch.distributed as dist, xcoll
from accelerate import Accelerator
accelerator = Accelerator(cpu=True)
rank, dev = accelerator.process_index, accelerator.device
say("state", accelerator.distributed_type, dev.type, dist.is_initialized() and dist.get_backend())
out = xcoll.gather({"p": (torch.arange(3.0) + 10 * rank).to(dev)})
total = xcoll.reduce({"c": torch.tensor([3 + rank], device=dev)}, "sum")
got = xcoll.broadcast({"b": torch.tensor([rank + 5.0], device=dev)}, src=1)
say("xcoll", rank, out["p"].tolist(), total["c"].tolist(), got["b"].tolist())


def snippet(code):
    # the namespace tests/test_migration.py gives the snippets
    g = torch.Generator().manual_seed(rank)
    tree = {"logits": torch.randn(4, 3, generator=g).to(dev),
            "labels": (torch.arange(4) + 10 * rank).to(dev)}
    obj = {"rank": rank, "name": f"r{rank}", "values": [1.5, None]}
    torch.manual_seed(rank)
    ns = {"torch": torch, "xcoll": xcoll, "tree": tree, "obj": obj, "rank": rank, "dev": dev}
    exec(code, ns)
    return ns["result"]


def same(a, b):
    la, sa = optree.tree_flatten(a, none_is_leaf=True)
    lb, sb = optree.tree_flatten(b, none_is_leaf=True)
    return sa == sb and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb)
    )


for title, marker, before, after in SECTIONS:
    theirs, ours = snippet(before), snippet(after)
    if "not compared" in marker:
        say("ran", title)
        continue
    if "sorted" in marker:
        theirs = theirs.sort().values
    say("same" if same(theirs, ours) else "differs", title)
dist.destroy_process_group()  # (as docs/launchers.md says: else gloo may abort at exit)
"""


def test_accelerate_with_use_torch_xla_0_in_a_torchrun_job_runs_xcoll_and_the_migration(
    tmp_path,
):
    from tests.test_migration import SECTIONS

    accelerate = [
        (title, blocks["before"][0], blocks["before"][1], blocks["after"][1])
        for title, blocks in SECTIONS.items()
        if blocks["before"][0].startswith("before: gloo")
    ]
    assert len(accelerate) == 10  # (accelerate's 8, and torch.distributed's per-tensor 2)
    code = f"SECTIONS = {accelerate!r}\n" + _ACCELERATE_GLOO
    result = torchrun(tmp_path, code, {"USE_TORCH_XLA": "0"})
    # (lines that end with each text: gloo's C++ prints into the same stdout,
    # and its "[Gloo] Rank ..." can land at the start of another process's line)
    out = result.stdout.splitlines()

    def ending(text: str) -> int:
        return sum(line.endswith(text) for line in out)

    assert ending("state DistributedType.MULTI_CPU cpu gloo") == 2, result.stdout
    for r in (0, 1):
        assert ending(f"xcoll {r} [0.0, 1.0, 2.0, 10.0, 11.0, 12.0] [7] [6.0]") == 1, result.stdout
    for title, marker, _, _ in accelerate:
        word = "ran" if "not compared" in marker else "same"
        assert ending(f"{word} {title}") == 2, (title, result.stdout)


_CAUGHT = """
import torch, torch.distributed as dist, xcoll
dist.init_process_group("gloo")
r = dist.get_rank()
xcoll.gather({"w": torch.ones(1)})
try:
    xcoll.gather({("a" if r == 0 else "b"): torch.ones(2)})
except xcoll.CollectiveMismatchError:
    print("caught", flush=True)
dist.destroy_process_group()
"""


def test_gloo_processes_exit_cleanly_after_a_caught_mismatch(tmp_path):
    # xcoll once kept the process group alive past destroy_process_group, and
    # its destructor at interpreter exit aborted 5 runs in 12
    for _ in range(3):
        assert torchrun(tmp_path, _CAUGHT).stdout.count("caught") == 2


_ABORT = "terminate called without an active exception"


def test_the_exit_abort_reproducer_runs_and_its_one_line_fix_exits_cleanly(tmp_path):
    # docs/launchers.md: plain torch.distributed with optree imported may abort
    # at exit (5 runs in 12); destroy_process_group is the fix it names
    code = snippet("exit")
    fixed = code.replace("# dist.destroy_process_group()  <- the one-line fix", "dist.destroy_process_group()")
    assert fixed != code
    script = tmp_path / "script.py"
    script.write_text(code)
    result = run(script, {}, *TORCHRUN_2)
    assert result.returncode == 0 or _ABORT in result.stderr, result.stderr[-3000:]
    for _ in range(3):
        torchrun(tmp_path, fixed)


# torchrun's environment says 2 processes, but nothing joins them: each would
# be a world of one, returning its own values alone.
_NO_PROCESS_GROUP = _SAY + """
import os, torch, xcoll
calls = {
    "gather": lambda: xcoll.gather({"x": torch.ones(1)}),
    "gather_object": lambda: xcoll.gather_object(1),
    "world_size": xcoll.world_size,
}
for name, call in calls.items():
    try:
        say("returned", name, call())
    except RuntimeError as e:
        say("raised", name, os.environ["RANK"], e)
"""


def test_torchrun_without_init_process_group_raises_on_every_process(tmp_path):
    out = torchrun(tmp_path, _NO_PROCESS_GROUP).stdout.splitlines()
    assert not [x for x in out if x.startswith("returned")], out
    for name in ("gather", "gather_object", "world_size"):
        for r in range(2):
            started = f"rank {r} of 2 (torchrun's environment: WORLD_SIZE=2)"
            lines = [x for x in out if x.startswith(f"raised {name} {r} ")]
            assert len(lines) == 1 and started in lines[0], out
            assert "call torch.distributed.init_process_group first" in lines[0], lines


@needs_xla
def test_torch_xla_launch_runs_the_replicas_in_a_child_process(tmp_path):
    # docs/launchers.md: what main() leaves in module-level state stays in the
    # child process that ran the replicas; the parent's copy stays empty
    script = tmp_path / "script.py"
    script.write_text(snippet("results"))
    result = run(script, {**XLA_CPU, "XLA_THREAD_POOL_SIZE": "16"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "results in the parent: {}", result.stdout


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_on_two_nodes_runs_the_eval_loop(from_wheel, tmp_path):
    # docs/launchers.md, "Across hosts", on this machine: two torchrun agents,
    # one per node, that meet by c10d rendezvous on 127.0.0.1 and start two
    # processes each; every process runs xcoll's example eval loop (from the
    # wheel) and checks its gathered result against one process's.
    port = _free_port()
    agents = [
        subprocess.Popen(
            command("nodes", {"NODE0:29400": f"127.0.0.1:{port}"}),
            env={**clean_env(), **from_wheel},
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [agent.communicate(timeout=300) for agent in agents]
    for agent, (_, err) in zip(agents, outs, strict=True):
        assert agent.returncode == 0, err[-3000:]
    lines = sorted(
        line for out, _ in outs for line in out.splitlines() if line.startswith("rank ")
    )
    assert len(lines) == 4, outs
    nodes = {}
    for r, line in enumerate(lines):
        assert line.startswith(f"rank {r} of 4 (node "), line
        assert line.endswith(": OK against one process"), line
        assert "1001 samples" in line, line
        nodes.setdefault(line.split("(node ")[1][0], []).append(r)
    assert sorted(nodes.values()) == [[0, 1], [2, 3]], lines  # two processes on each node


def _variables_read(tree) -> set[str]:
    """The names that code reads from the environment: ``os.environ.get("NAME")``
    and ``os.environ.setdefault("NAME", ...)`` calls, the keys of ``_DOWNCASTS`` (xcoll/_backends/xla.py) and the size
    and rank variables of ``_LAUNCHERS`` (xcoll/_backends/_launch.py)."""
    import ast

    read = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) in ("os.environ.get", "os.environ.setdefault")
            and isinstance(node.args[0], ast.Constant)
        ):
            read.add(node.args[0].value)
        elif isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "_DOWNCASTS":
            read |= {k.value for k in node.value.keys}
        elif isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "_LAUNCHERS":
            read |= {e.elts[i].value for e in node.value.elts for i in (0, 1)}
    return read


def test_the_docs_list_every_environment_variable_xcoll_reads():
    import ast

    read = set()
    for path in (pathlib.Path(__file__).resolve().parents[1] / "xcoll").rglob("*.py"):
        if not {"testing", "examples"} & set(path.parts):  # (the pools, the examples)
            read |= _variables_read(ast.parse(path.read_text()))
    assert {"XCOLL_CHECK", "WORLD_SIZE", "PMI_RANK", "XLA_USE_BF16"} <= read  # (found)
    table = DOC.read_text().split("<!-- environment -->", 1)[1].split("\n\n", 1)[0]
    rows = table.strip().splitlines()[2:]
    listed = {name for row in rows for name in row.split("|")[1].split("`")[1::2]}
    assert listed == read


README = DOC.parents[1] / "README.md"


@needs_xla
def test_xcoll_launch_runs_the_readmes_example_on_four_cpu_replicas(tmp_path):
    """``python -m xcoll.launch --cpu 4 example.py``, the README's first
    example as it stands, in an environment with no XLA setting: the
    launcher sets them, and every replica prints its line."""
    script = tmp_path / "example.py"
    script.write_text(README.read_text().split("```python\n", 1)[1].split("```", 1)[0])
    result = run(script, {}, "-m", "xcoll.launch", "--cpu", "4")
    assert result.returncode == 0, result.stderr[-3000:]
    # (read by a pattern, not by lines: replica threads' prints interleave,
    # and print writes its text and its newline apart)
    found = re.findall(
        r"(\d) of 4: torch\.Size\(\[32, 5\]\) \{'loss': tensor\(([-\d.]+), device='xla:\d'\), 'seen': 32\} "
        r"\{'seed': 1234\}",
        result.stdout,
    )
    assert sorted(rank for rank, _ in found) == ["0", "1", "2", "3"], result.stdout
    assert len({loss for _, loss in found}) == 1, found  # (the mean loss, alike on every replica)


@needs_xla
def test_xcoll_launch_names_a_failed_replica_and_exits_with_1(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text(
        "import torch, torch_xla, xcoll\n"
        "if xcoll.rank() == 1:\n"
        "    raise ValueError('a bad replica')\n"
        "xcoll.reduce(torch.ones(1).to(torch_xla.device()))\n"
    )
    result = run(script, {}, "-m", "xcoll.launch", "--cpu", "2", timeout=120)
    assert result.returncode == 1, (result.returncode, result.stderr[-3000:])
    assert "xcoll.launch: replica 1 failed:" in result.stderr, result.stderr[-3000:]
    assert "ValueError: a bad replica" in result.stderr, result.stderr[-3000:]
