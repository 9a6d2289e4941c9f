"""What a finished run writes for people: ``report.md`` with PNG plots, and atomic files.

Shared by every runner (`fedring simulate`, the MQTT coordinator) and by the
CLI; it imports no runner. matplotlib is loaded only when a report is drawn
(`fedring.report.plots`), so importing this package stays cheap.
"""

from fedring.report.files import atomic_write, jsonl
from fedring.report.markdown import write_report, write_report_for

__all__ = ["atomic_write", "jsonl", "write_report", "write_report_for"]
