"""ALFWorld-mini, suite version mini_v1: `<split>.json.gz` (48 train, 16 valid_seen, 24
valid_unseen games; 3-4 receptacles, 1-2 distractor object classes, 4-8 step plans).

A package (not a plain folder) so the files ship with the wheel. Written, and checked
byte for byte, by env_servers/alfworld/mini.py:
  python -m env_servers.alfworld.mini --out env_servers/alfworld/data/mini_v1
  python -m env_servers.alfworld.mini --check
Play: AlfworldEnv(data_dir="env_servers/alfworld/data/mini_v1"), i.e.
  --config.env.args.data_dir=env_servers/alfworld/data/mini_v1
"""
