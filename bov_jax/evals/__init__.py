"""Evaluation: bits per byte (`bpb`), the CORE harness (`core`), its bundle builder (`bundle`)."""
