"""Tools over a converted module: report, diagnostics, export and save, deployment copy, drawing, command line."""
