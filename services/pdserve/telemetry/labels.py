"""The labels every pdserve metric carries: its served model, the process's role, and the
process itself (`metrics.ProcessLabels` holds one process's values)."""

LABELS = ("model_name", "role", "worker")
