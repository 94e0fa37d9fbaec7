"""Broken: calls sys.exit while importing."""
import sys

sys.exit(3)
