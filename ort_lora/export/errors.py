"""The one exception type the exporter raises for problems a user can fix."""


class ExportError(Exception):
    """Bad input to `ort-lora export` / `export_model`; the message is meant for users."""
