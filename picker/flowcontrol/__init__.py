"""Flow control: the reference's policy plugin types (`policies`), accepted so reference
configs load; requests are not yet queued at the picker.

May import: framework.
"""
