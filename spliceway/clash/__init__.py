"""Clash and mihomo: their configuration language, read into spliceway's.

Pure functions over documents (no I/O beyond what a caller hands in): the YAML 1.2
loader, proxies and share links turned into outbounds, rule lines turned into rule
conditions, and the importer that turns a whole Clash configuration into a spliceway one
with a report of what it changed or skipped.
"""
