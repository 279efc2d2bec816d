"""Developer tools outside the running engine.

- ``docgen``  generates the reference parts of ``docs/`` from the code
"""
