"""What survives a run: the atomic snapshot writer, user save_state/load_state, optimizer-state layout, run dir."""
