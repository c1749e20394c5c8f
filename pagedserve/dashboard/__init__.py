"""The live view of the KV pool (served at /dashboard) and its static replay report."""
