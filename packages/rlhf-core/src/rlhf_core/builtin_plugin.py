"""rlhf-core's own registrations, loaded through its ``rlhf`` entry point like any third-party plugin."""
