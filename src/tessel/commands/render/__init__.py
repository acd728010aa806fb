"""Rich rendering of the typed results the command functions get back (one module per command)."""
