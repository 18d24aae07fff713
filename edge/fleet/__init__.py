"""What a device tells its fleet: start/reload history, identity metrics, the timeline, the agent and the alert rules."""
