"""Deployment tools: the offline install bundle for air-gapped GPU hosts (docs/deploy.md)."""
