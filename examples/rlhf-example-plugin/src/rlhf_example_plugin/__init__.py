"""rlhf-example-plugin."""
