"""The rank's control plane: slot table, lockstep channel, step loop, Worker service."""
