"""The TUI's screens, one module each; ``base.NodeScreen`` is their common base."""
