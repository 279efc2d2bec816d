"""Developer tools outside the running engine.

- ``docgen``     generates the reference parts of ``docs/`` from the code
- ``configdoc``  its configuration reference page (from the configuration models)
- ``markdown``   its Markdown tables and JSON Schema in words
"""
