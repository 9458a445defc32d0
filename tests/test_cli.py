"""The ``roundpipe`` command line."""

from __future__ import annotations

import json

import pytest

from roundpipe.cli import main


def test_partition_prints_a_plan_as_json(capsys):
    main(["partition", "qwen3-8b", "--stages", "8", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert plan  # a non-empty plan object


def test_an_unknown_command_lists_the_known_ones(capsys):
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "demo" in err and "partition" in err
