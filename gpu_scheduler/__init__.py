"""Pure scheduling decisions: which queued jobs run next and where. No Django, no I/O."""
