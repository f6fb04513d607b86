"""Where a scratch may be made, and how much room it needs (issue 23, item 4).

A scratch root comes from ``XDG_CACHE_HOME`` (else ``HOME``); one that is not
an absolute, existing directory of the caller's (or is ``/``) is refused with
the value and where it came from, before anything is made or started. A
free-space floor is on by default for every scratch and the configuration
changes it. Every test runs the real commands and looks at the paths.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import HOLD, as_user, unpriv_python, update_config

NPU_HOLD = str(Path(sys.executable).parent / "npu-hold")


def run_scratch(
    tmp_path: Path, env: dict[str, str], *, argv: list[str] | None = None, cwd: Path | None = None
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``hold run --scratch -- sh -c 'echo $HOLD_SCRATCH > ran'``; the result and ``ran``."""
    ran = tmp_path / "ran"
    cmd = argv or [*HOLD, "run", "--scratch"]
    res = subprocess.run(
        [*cmd, "--", "sh", "-c", f'echo "$HOLD_SCRATCH" > {ran}'],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd or tmp_path,
    )
    return res, ran


def env_with(**kv: str | None) -> dict[str, str]:
    env = dict(os.environ)
    for k, v in kv.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def test_xdg_cache_home_root_directory_is_refused(tmp_path: Path) -> None:
    if os.path.exists("/hold"):
        pytest.skip("/hold exists here already: cannot show that nothing was made there")
    try:
        res, ran = run_scratch(tmp_path, env_with(XDG_CACHE_HOME="/"))
        assert res.returncode == 2, res.stderr
        assert "scratch root: '/' (from XDG_CACHE_HOME) is the root directory /" in res.stderr
        assert not ran.exists() and not os.path.exists("/hold")
    finally:  # what a failure made, and only that (it did not exist before)
        for made in ("/hold/scratch", "/hold"):
            with contextlib.suppress(OSError):
                os.rmdir(made)


def test_relative_xdg_cache_home_is_refused(tmp_path: Path) -> None:
    cwd = tmp_path / "a" / "b"
    cwd.mkdir(parents=True)
    res, ran = run_scratch(tmp_path, env_with(XDG_CACHE_HOME="./.."), cwd=cwd)
    assert res.returncode == 2, res.stderr
    assert "scratch root: './..' (from XDG_CACHE_HOME) is a relative path" in res.stderr
    assert not ran.exists()
    assert not (tmp_path / "a" / "hold").exists() and not (cwd / "hold").exists()


def test_missing_home_is_refused_and_not_made(tmp_path: Path) -> None:
    home = f"/nonexistent-{uuid.uuid4().hex}"
    try:
        res, ran = run_scratch(tmp_path, env_with(XDG_CACHE_HOME=None, HOME=home))
        assert res.returncode == 2, res.stderr
        assert (
            f"scratch root: {home!r} (from HOME (XDG_CACHE_HOME is not set)) does not exist"
            in res.stderr
        ), res.stderr
        assert not ran.exists() and not os.path.exists(home)
    finally:  # what a failure made (a fresh name: nobody else's)
        shutil.rmtree(home, ignore_errors=True)


@pytest.mark.parametrize("case", ["file", "dotdot", "others"])
def test_other_bad_roots_are_refused(tmp_path: Path, other_user: str, case: str) -> None:
    if case == "file":
        value, why = tmp_path / "afile", "is not a directory"
        value.write_text("")
    elif case == "dotdot":
        (tmp_path / "x").mkdir()
        value, why = tmp_path / "x" / "..", "contains '..'"
    else:
        value = tmp_path / "theirs"
        value.mkdir()
        os.chown(value, pwd.getpwnam(other_user).pw_uid, -1)
        why = f"is owned by uid {value.stat().st_uid}, not by you (uid 0)"
    res, ran = run_scratch(tmp_path, env_with(XDG_CACHE_HOME=str(value)))
    assert res.returncode == 2, res.stderr
    assert f"scratch root: {str(value)!r} (from XDG_CACHE_HOME) {why}" in res.stderr, res.stderr
    assert not ran.exists()
    assert not (tmp_path / "hold").exists() and not (tmp_path / "theirs" / "hold").exists()


def test_unprivileged_user_refused_a_root_that_is_not_theirs(
    tmp_path: Path, unpriv_user: str, unpriv_runtime: Path
) -> None:
    """As the user: XDG_CACHE_HOME=/tmp (root's, shared) and HOME=/nonexistent."""
    py = unpriv_python()
    for p in [tmp_path, *tmp_path.parents]:
        if p == Path("/"):
            break
        os.chmod(p, os.stat(p).st_mode | 0o055)
    state = Path(os.environ["HOLD_STATE_DIR"])
    pw = pwd.getpwnam(unpriv_user)
    state.mkdir(mode=0o700)
    os.chown(state, pw.pw_uid, pw.pw_gid)
    work = tmp_path / "shared"
    work.mkdir()
    work.chmod(0o777)
    home = f"/nonexistent-{uuid.uuid4().hex}"
    for env, expect in (
        ({"XDG_CACHE_HOME": "/tmp"}, "'/tmp' (from XDG_CACHE_HOME) is owned by uid 0, not by you"),
        ({"HOME": home}, f"{home!r} (from HOME (XDG_CACHE_HOME is not set)) does not exist"),
    ):
        argv = [py, "-m", "hold", "run", "--scratch", "--", "touch", str(work / "ran")]
        full = {"HOLD_STATE_DIR": str(state), "XDG_CONFIG_HOME": str(work / "xdg"), **env}
        res = subprocess.run(
            as_user(unpriv_user, argv, unpriv_runtime, full),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
            cwd=work,
        )
        assert res.returncode == 2, res.stderr
        assert f"scratch root: {expect}" in res.stderr, res.stderr
        assert not (work / "ran").exists()
    assert not os.path.exists(home)


# --------------------------------------------------------------------------
# The free-space floor.


def test_default_floor_passes_here(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    res, ran = run_scratch(tmp_path, env_with(XDG_CACHE_HOME=str(cache)))
    assert res.returncode == 0, res.stderr
    assert ran.read_text().strip().startswith(str(cache / "hold" / "scratch" / "run-"))


@pytest.mark.parametrize("prog", ["hold run", "npu-hold"])
def test_a_floor_above_the_free_space_refuses_before_the_command(tmp_path: Path, prog: str) -> None:
    cfg = update_config(tmp_path, scratch={"min_free": "1000000T"})
    cache = tmp_path / "cache"
    cache.mkdir()
    argv = [*HOLD, "run", "--scratch"] if prog == "hold run" else [NPU_HOLD, "--scratch"]
    res, ran = run_scratch(tmp_path, env_with(XDG_CACHE_HOME=str(cache)), argv=argv)
    assert res.returncode == 2, res.stderr
    assert "1000000.0 TiB required (min_free)" in res.stderr, res.stderr
    assert "Nothing was started" in res.stderr
    assert not ran.exists() and not (cache / "hold").exists()
    # 0 turns the floor off.
    cfg.write_text(cfg.read_text().replace("1000000T", "'0'"))
    res, ran = run_scratch(tmp_path, env_with(XDG_CACHE_HOME=str(cache)), argv=argv)
    assert res.returncode == 0, res.stderr
    assert ran.exists()


def test_the_default_floor_refuses_a_small_filesystem(tmp_path: Path) -> None:
    """On by default: a 4 MiB tmpfs has less than the default floor (1 GiB)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(small)],
        capture_output=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        res, ran = run_scratch(tmp_path, env_with(XDG_CACHE_HOME=str(small)))
        assert res.returncode == 2, res.stderr
        assert f"free in {small}/hold/scratch, 1.0 GiB required (min_free): the default" in (
            res.stderr
        ), res.stderr
        assert not ran.exists() and list(small.iterdir()) == []
        # The configuration changes it.
        update_config(tmp_path, scratch={"min_free": "1M"})
        res, ran = run_scratch(tmp_path, env_with(XDG_CACHE_HOME=str(small)))
        assert res.returncode == 0, res.stderr
        assert ran.read_text().startswith(str(small / "hold" / "scratch"))
    finally:
        subprocess.run(["umount", str(small)], check=True)


def _stack(tmp_path: Path, scratch: str) -> Path:
    path = tmp_path / "stack.yaml"
    path.write_text(
        "name: floor\nunits:\n"
        f"  a: {{cmd: [sh, -c, 'touch {tmp_path}/ran; exec sleep 60'], scratch: {scratch}}}\n"
    )
    return path


def test_a_stack_units_scratch_takes_the_configurations_floor(tmp_path: Path) -> None:
    update_config(tmp_path, scratch={"min_free": "1000000T"})
    cache = tmp_path / "cache"
    cache.mkdir()
    env = env_with(XDG_CACHE_HOME=str(cache))

    def up(path: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*HOLD, "up", "--for", "200ms", str(path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
        )

    res = up(_stack(tmp_path, "{}"))
    assert res.returncode == 2, res.stderr
    assert "units.a.scratch: scratch: " in res.stderr and "1000000.0 TiB required" in res.stderr
    assert not (tmp_path / "ran").exists() and not (cache / "hold").exists()
    # A unit's own min_free is its own.
    res = up(_stack(tmp_path, "{min_free: 1M}"))
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "ran").exists()


def test_a_bad_floor_in_the_configuration_names_file_and_line(tmp_path: Path) -> None:
    cfg = update_config(tmp_path, scratch={"min_free": "lots"})
    res, ran = run_scratch(tmp_path, env_with())
    assert res.returncode == 2, res.stderr
    line = next(i for i, t in enumerate(cfg.read_text().splitlines(), 1) if "min_free" in t)
    assert f"{cfg}:{line}: scratch.min_free 'lots' is not valid: a size such as 500M" in (
        res.stderr
    ), res.stderr
    assert not ran.exists()
