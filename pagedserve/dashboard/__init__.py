"""The live view of the KV pool: the front's copy of the pool and its frames (`live.py`), the page
served at /dashboard (`static/`), and the walk-through written as a self-contained replay page
(`walkthrough.py`, `report.py`)."""
