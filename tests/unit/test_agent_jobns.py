"""The isolation prefix of process jobs and the hiding of loader variables (no processes;
the real behaviour is in tests/integration/test_agent_hardening.py)."""

from __future__ import annotations

from gpufleet.agent import shim
from gpufleet.agent.runtime.jobns import Isolation, hide_loader_env

FULL = Isolation("/usr/bin/setpriv", "/usr/bin/unshare", "/usr/bin/mount", hide_pids=True)


def test_loader_variables_are_renamed_and_the_rest_kept() -> None:
    env = {
        "PATH": "/usr/bin",
        "LD_PRELOAD": "/x.so",
        "LD_LIBRARY_PATH": "/opt/cuda/lib64",
        "GLIBC_TUNABLES": "glibc.malloc.check=3",
        "LD_NOT-AN-IDENTIFIER": "v",
        "OLD_LD_PRELOAD": "kept",
    }
    out, hidden = hide_loader_env(env)
    assert hidden == ("GLIBC_TUNABLES", "LD_LIBRARY_PATH", "LD_PRELOAD")
    assert out == {
        "PATH": "/usr/bin",
        "_GF_ENV_LD_PRELOAD": "/x.so",
        "_GF_ENV_LD_LIBRARY_PATH": "/opt/cuda/lib64",
        "_GF_ENV_GLIBC_TUNABLES": "glibc.malloc.check=3",
        "LD_NOT-AN-IDENTIFIER": "v",
        "OLD_LD_PRELOAD": "kept",
    }


def test_prefix_is_no_new_privs_then_a_private_mount_namespace() -> None:
    assert FULL.shim_prefix(namespace=True) == [
        "/usr/bin/setpriv",
        "--no-new-privs",
        "--",
        "/usr/bin/unshare",
        "--mount",
        "--ipc",
        "--propagation",
        "private",
        "--",
    ]
    assert FULL.shim_prefix(namespace=False) == ["/usr/bin/setpriv", "--no-new-privs", "--"]
    assert Isolation().shim_prefix(namespace=True) == []


def test_shim_gets_the_mounts_only_in_a_namespace() -> None:
    opts = FULL.shim_options(namespace=True, tmp_dir="/j/r1/tmp")
    argv = shim.argv(exit_file="/e", log_file="/l", command=["true"], **opts)  # type: ignore[arg-type]
    assert argv[argv.index("--mount-bin") + 1] == "/usr/bin/mount"
    assert argv[argv.index("--private-tmp") + 1] == "/j/r1/tmp"
    assert FULL.shim_options(namespace=False, tmp_dir="/t") == {}
    no_hide = Isolation("/s", "/u", "/m", hide_pids=False)
    assert "--hide-pids" not in shim.argv(
        exit_file="/e",
        log_file="/l",
        command=["true"],
        **no_hide.shim_options(namespace=True, tmp_dir="/t"),  # type: ignore[arg-type]
    )


def test_label_text_says_what_is_in_force() -> None:
    assert FULL.describe() == "no-new-privs.private-tmp.hidepid"
    assert FULL.describe(namespace=False) == "no-new-privs"
    assert Isolation().describe() == "none"


def test_restore_env_goes_to_the_shim_as_names_only() -> None:
    argv = shim.argv(
        exit_file="/e", log_file="/l", command=["true"], restore_env=("LD_PRELOAD", "TMPDIR")
    )
    assert argv[argv.index("--restore-env") + 1] == "LD_PRELOAD,TMPDIR"
    assert "/x.so" not in " ".join(argv)
