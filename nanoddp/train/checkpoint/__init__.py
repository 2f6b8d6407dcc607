"""What survives a run: snapshot files, user save_state/load_state, optimizer-state layout, run dir."""
