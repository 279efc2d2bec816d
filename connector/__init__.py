"""Event delivery to webhooks and files (installed as ``spliceway.connector``)."""
