"""The fast tier, `-m "not slow and not heavy"`: in a test marked neither slow nor heavy, every
door to a new process refuses, says to mark the test, and is recorded even where the code under
test catches the refusal (conftest.py's guard)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.util
import os
import subprocess
import sys
from collections.abc import Callable

import pytest
from conftest import refuse_processes


def test_every_door_to_a_process_refuses_in_an_unmarked_test() -> None:
    doors: dict[str, Callable[[], object]] = {
        "subprocess": lambda: subprocess.run(["true"], check=False),
        "multiprocessing": lambda: multiprocessing.get_context("spawn").Process().start(),
        "multiprocessing's helper": lambda: multiprocessing.util.spawnv_passfds(
            os.fsencode(sys.executable), [sys.executable, "-c", "pass"], ()),
        "os.fork": lambda: os.fork(),  # noqa: PLW0108  (looked up once patched, not before)
        "os.posix_spawn": lambda: os.posix_spawn("/bin/true", ["true"], {}),
        "os.system": lambda: os.system("true"),
    }
    started: list[str] = []
    with pytest.MonkeyPatch.context() as patch:  # in place of the guard's own, meanwhile
        refuse_processes(patch, started)
        for start in doors.values():
            with pytest.raises(pytest.fail.Exception, match=r"mark it @pytest\.mark\.slow"):
                start()
    assert started == list(doors)
