"""Analyses of a compiled graph: typed reports rendered into plan.json and report.md."""
