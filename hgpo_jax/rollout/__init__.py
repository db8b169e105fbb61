"""Step-wise rollouts: tasks, per-step prompts, action projection and trajectory collection.

`rollout.collect` plays G tasks x N trajectories through the env pool and the sampler;
`tasks` reads the task datasets, `prompts` builds each step's prompt, `projection` turns
a response into an env action, `hiper` holds HiPER's response format, `params` the
validated `config.rollout` (`RolloutParams`).
"""
