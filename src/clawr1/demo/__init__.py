"""The personal-agent demo: simulated users, live learning, held-out evaluation."""
