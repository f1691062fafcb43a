"""Evaluation suite: task data (``tasks``, ``data``) and metrics (``metrics``), no model code."""
