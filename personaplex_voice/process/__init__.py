"""Process-level code shared by every server process: TLS certificates (tls.py)."""
