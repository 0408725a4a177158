"""Tables, figures and the written report, all computed from the files under results/."""
