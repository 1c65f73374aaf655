raise AssertionError("this module must never be imported: its blockzoo requirement excludes the core")
