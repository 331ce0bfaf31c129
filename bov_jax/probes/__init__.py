"""Recall and long-context probes: MQAR accuracy, loss by position, induction, passkey."""
