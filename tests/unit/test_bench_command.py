"""A bench table's command line is one a reader can paste: an argument with a space stays one
argument (a checkout's label, 'vlmq at b1fe667')."""

from __future__ import annotations

import shlex

from bench.common import command_line


def test_a_label_with_spaces_is_quoted_so_the_command_runs_as_it_ran():
    argv = ["--against", "CHECKOUT", "--label", "vlmq at b1fe667", "--tasks", "2000"]
    line = command_line("bench.redis_phases", argv)
    assert (
        line
        == "python -m bench.redis_phases --against CHECKOUT --label 'vlmq at b1fe667' --tasks 2000"
    )
    assert shlex.split(line)[3:] == argv
