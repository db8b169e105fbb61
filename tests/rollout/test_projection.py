"""Action projection (docs/algorithms.md §1): validity rules and the fallback text."""

import pytest

from hgpo_jax.rollout import projection


@pytest.mark.parametrize("response,action,valid", [
    ("<think>go</think><action>Go To Fridge 1</action>", "go to fridge 1", True),
    ("<think>x</think> <action> take apple 1 from table 1 </action> trailing", "take apple 1 from table 1", True),
    # missing think tags: action still extracted, marked invalid
    ("<action>look</action>", "look", False),
    ("<think>x<action>look</action>", "look", False),
    # CJK characters invalidate the response
    ("<think>去冰箱</think><action>go to fridge 1</action>", "go to fridge 1", False),
    # the first <action> ... first following </action>
    ("<think>a</think><action>open drawer 1</action><action>look</action>", "open drawer 1", True),
])
def test_projection_rules(response, action, valid):
  assert projection.project_action(response) == (action, valid)


def test_missing_action_tags_fall_back_to_last_chars():
  response = "<think>hmm</think> I would like to go to the fridge number one please"
  action, valid = projection.project_action(response, fallback_chars=30)
  assert not valid
  assert action == response.lower()[-30:]
  assert len(action) == 30
  action, valid = projection.project_action(response, fallback_chars=20)
  assert action == response.lower()[-20:]


def test_unclosed_action_tag_is_invalid():
  action, valid = projection.project_action("<think>a</think><action>look", fallback_chars=10)
  assert (action, valid) == ("ction>look", False)


def test_constrained_mode_does_not_require_think():
  assert projection.project_action("<action>look</action>", require_think=False) == ("look", True)
