"""The registered "mcrdl" torch backend in one process: the autoload entry point, the
``python -m mcrdl_torch.run`` launcher, and refusals. Each case runs in a fresh
interpreter (torch's default group is process-global)."""
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    dist.init_process_group("mcrdl")
    t = torch.arange(4.0)
    w = dist.all_reduce(t, async_op=True)
    print("backend", dist.get_backend(), "value", w.get_future().wait()[0].tolist(),
          "argv", sys.argv[1:])
    dist.destroy_process_group()
""")


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "HYDRA_CONTROL_FD", "MPI_LOCALNRANKS")}
    env.update(MCRDL_TUNING_TABLE="none", MCRDL_TIMEOUT="30", RANK="0", WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    env.update(extra)
    return env


def _py(args, env, cwd=None):
    return subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def test_plain_import_torch_registers_mcrdl(tmp_path):
    """The torch.backends entry point: nothing but `import torch` in the program."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    proc = _py([str(script)], _env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "backend mcrdl value [0.0, 1.0, 2.0, 3.0]" in proc.stdout


def test_import_torch_loads_no_mcrdl_code():
    """The entry point registers the backend without importing mcrdl_torch or mcrdl_core:
    every `import torch` would pay for them, and a broken install would break torch."""
    code = ("import sys, torch, torch.distributed as dist; "
            "print('registered', 'MCRDL' in dist.Backend._plugins, "
            "sorted(m for m in sys.modules if m.startswith(('mcrdl_core', 'mcrdl_torch', 'mcrdl_jax'))))")
    proc = _py(["-c", code], _env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "registered True []" in proc.stdout, proc.stdout


def test_run_module_without_autoload(tmp_path):
    """TORCH_DEVICE_BACKEND_AUTOLOAD=0 turns the entry point off; the launcher registers
    the backend and passes the script its arguments."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    off = _py(["-c", "import torch, torch.distributed as d; print('MCRDL' in d.Backend._plugins)"],
              _env(TORCH_DEVICE_BACKEND_AUTOLOAD="0"))
    assert off.stdout.strip() == "False", off.stderr[-2000:]
    proc = _py(["-m", "mcrdl_torch.run", str(script), "--lr", "0.1"],
               _env(TORCH_DEVICE_BACKEND_AUTOLOAD="0"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "backend mcrdl" in proc.stdout and "argv ['--lr', '0.1']" in proc.stdout


def test_autoload_never_raises_and_a_wrong_rank_is_refused():
    """A failure inside the entry point must not break `import torch`; a rank torch was
    told that disagrees with the launcher's is refused with advice before any call; an
    mcrdl subgroup under a gloo default group works (its core id must be a valid MPI
    tag: the first version's id was not)."""
    code = textwrap.dedent("""
        import torch, torch.distributed as dist
        import mcrdl_autoload as autoload
        try:
            dist.init_process_group("mcrdl", store=dist.HashStore(), rank=1, world_size=2)
        except ValueError as exc:
            print("refused:", exc)
        # an mcrdl subgroup under another default backend: the creator's subgroup path
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        g = dist.new_group(backend="mcrdl", pg_options="mpi")
        t = torch.arange(3.0)
        dist.all_reduce(t, group=g)
        print("subgroup", dist.get_backend(g), t.tolist())
        dist.Backend._plugins.pop("MCRDL", None)
        def broken(*a, **k):
            raise RuntimeError("boom")
        dist.Backend.register_backend = broken
        autoload.register()
        print("survived", "MCRDL" in dist.Backend._plugins)
    """)
    proc = _py(["-c", code], _env(MCRDL_BOOTSTRAP="mpi"))  # an MPI singleton: mpi works
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "survived False" in proc.stdout
    assert "subgroup mcrdl [0.0, 1.0, 2.0]" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "refused:" in proc.stdout and "launcher says rank 0 of 1" in proc.stdout, \
        proc.stdout + proc.stderr[-2000:]


def test_run_module_names_a_missing_script():
    proc = _py(["-m", "mcrdl_torch.run", "no_such_script.py"], _env())
    assert proc.returncode != 0 and "no such script" in proc.stderr


def test_pg_options_forms():
    from mcrdl_torch.process_group import parse_options

    assert parse_options("mpi") == {"*": "mpi"}
    assert parse_options("all_reduce=gloo,all_to_all=mpi") == {"all_reduce": "gloo",
                                                               "all_to_all": "mpi"}
    assert parse_options({"all_reduce": "gloo"}) == {"all_reduce": "gloo"}
    with pytest.raises(ValueError, match="pg_options"):
        parse_options(3)
