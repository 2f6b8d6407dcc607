"""The trainer's data: the resumable distributed sampler, built-in datasets, text windows, batch rules."""
