"""Watching a pipeline's stage processes and recovering from what happens to them: their heartbeats
and the watchdog (`heartbeat`), spawning and stopping them (`launcher`), the supervisor behind a
serving engine that rebuilds the pipeline after a lost stage and switches to a new split live
(`supervisor`), and the watcher that decides when a new split pays (`remap_watch`)."""
