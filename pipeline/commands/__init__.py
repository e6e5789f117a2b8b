"""The commands that are not stages: each takes its own argv (not Hydra overrides) and is run as
`python -m pipeline <command> ...` (`pipeline.__main__.COMMANDS`). They sit on the top floor beside the entry
point: a command may import any package of `pipeline`, and nothing imports a command (docs/ARCHITECTURE.md,
"Floors"; tests/test_layout.py)."""
