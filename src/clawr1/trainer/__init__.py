"""The trainer: leases samples, trains LoRA (rl / opd / combine), publishes versions."""
