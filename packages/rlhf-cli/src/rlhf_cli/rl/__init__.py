"""The RL controller: prompts -> rollouts -> rewards -> experience -> advantages -> updates -> weight sync."""
