"""Run reports: markdown, a self-contained HTML page with plots, and the scored results as JSON."""

from mkb_eval.report.build import build_report, render_html, render_markdown

__all__ = ["build_report", "render_html", "render_markdown"]
