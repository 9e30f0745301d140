"""The command line on a user's own train step: FILE.py:FUNC and package.module:FUNC."""
from __future__ import annotations

import json
import textwrap

import pytest

from hapsynth.cli import main as cli_main

STEP = textwrap.dedent('''
    import jax
    import jax.numpy as jnp

    def make_step():
        def step(w, x):
            loss, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
            return w - 0.1 * g, loss
        return step, (jnp.ones((8, 4)) / 8, jnp.ones((32, 8)))

    def not_a_pair():
        return 3
''')


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_step.py"
    path.write_text(STEP)
    return path


def test_plan_a_step_from_a_file(user_file, capsys):
    assert cli_main(["plan", f"{user_file}:make_step", "--cluster", "cpu-2-6",
                     "--time-limit", "1", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["cluster"] == "cpu-2-6" and d["state_leaves"] == 1
    assert d["predicted_step_time"] <= min(d["baselines"]["DP-EV"], d["baselines"]["DP-CP"]) + 1e-12
    assert cli_main(["plan", f"{user_file}:make_step", "--cluster", "cpu-2-6",
                     "--time-limit", "1", "--json", "--all-devices"]) == 0
    assert json.loads(capsys.readouterr().out)["devices"] is None


def test_plan_twice_with_a_plan_cache(user_file, tmp_path, capsys):
    """The second `hapsynth plan --plan-cache DIR` reads the plan the first filed."""
    cmd = ["plan", f"{user_file}:make_step", "--cluster", "cpu-2-6", "--time-limit", "1",
           "--plan-cache", str(tmp_path / "plans")]
    assert cli_main(cmd) == 0
    assert "plan cache" not in capsys.readouterr().out
    assert cli_main(cmd) == 0
    (path,) = (tmp_path / "plans").glob("*.json")
    assert f"read from the plan cache: {path}" in capsys.readouterr().out


def test_inspect_a_step_from_a_module(user_file, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(user_file.parent))
    assert cli_main(["inspect", "my_step:make_step"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("my_step:make_step (your step)") and "dot_general" in out


@pytest.mark.parametrize("spec,message", [
    ("{dir}/missing.py:make_step", "no such file: {dir}/missing.py"),
    ("{file}:nowhere", "{file} has no function 'nowhere'"),
    ("{file}:not_a_pair", "{file}:not_a_pair() must return (train_step, example_args)"),
    ("no_such_module_here:make", "no module 'no_such_module_here'"),
    ("vgg16", "no zoo model 'vgg16'"),
])
def test_bad_steps_get_one_line_that_names_the_problem(user_file, capsys, spec, message):
    fill = {"dir": user_file.parent, "file": user_file}
    assert cli_main(["plan", spec.format(**fill), "--cluster", "cpu-2-6"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message.format(**fill) in err, err
