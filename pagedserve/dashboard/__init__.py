"""The KV dashboard: a static page (static/) that draws the block pool, the requests' block tables,
the event log and a few time series from frame JSON, live over server-sent events or replayed
from frames embedded in a self-contained report (report.py)."""
