"""The shipped training corpus (data files) and the script that rebuilt it."""
