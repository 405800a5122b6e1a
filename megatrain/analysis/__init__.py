"""Analysis of the records: tables, figures, the HTML reports, and the paper's claims they compare against."""
