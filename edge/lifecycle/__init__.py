"""Start, reload and serving's socket lifecycle: the loader, the loaded set, warm-up, the memory guard, systemd and the control socket."""
