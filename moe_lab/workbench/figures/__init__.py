"""The notebooks' figures. Each function draws on an Axes (created if not given) and returns
it, so a notebook can compose figures; matplotlib loads only when a figure is drawn."""
