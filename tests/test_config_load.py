"""`configs.common.load`, the one config loader of every entry point (launch.main,
launch.evaluate, launch.plan, launch.experiments): overrides read as their field's type,
and one-line errors naming the fix."""

import pytest

from configs import common

SPEC = "configs/sokoban.py:smoke"


def test_overrides_are_read_as_their_fields_type():
  c = common.load(SPEC, ["--config.train.lr=0.5", "--config.rollout.constrained=false",
                         "--config.model.name=123", "--config.env.eval_splits=()",
                         "--config.seed=7"])
  assert c.train.lr == 0.5 and c.rollout.constrained is False
  assert c.model.name == "123"  # a string field takes the text as it is
  assert c.env.eval_splits == () and c.seed == 7 and isinstance(c.seed, int)
  with pytest.raises(AttributeError):  # locked: a typo in code fails too
    c.train.no_such_field = 1


@pytest.mark.parametrize("spec, overrides, message", [
    ("configs/nope.py", [], "config file could not be loaded (No such file or directory: "
     "'configs/nope.py'); pass --config=configs/<env>.py[:args]"),
    (f"{SPEC},colour=red", [], "unknown config argument 'colour'; known: "),
    (SPEC, ["--config.train.lrr=0.1"], "unknown config field --config.train.lrr; did you mean "
     "--config.train.lr"),
    (SPEC, ["--config.train.lr=fast"], "flag --config.train.lr=fast: could not convert string "
     "to float: 'fast'; give the override a value of the field's type"),
    (SPEC, ["--config.rollout.constrained=maybe"], "flag --config.rollout.constrained=maybe: "
     "expected true or false"),
    (SPEC, ["--config.train.lr"], "override '--config.train.lr' needs a value"),
])
def test_bad_input_is_one_line_naming_the_fix(spec, overrides, message):
  with pytest.raises(common.ConfigLoadError) as e:
    common.load(spec, overrides)
  assert str(e.value).startswith(message) and "\n" not in str(e.value)
