"""ppo package."""
